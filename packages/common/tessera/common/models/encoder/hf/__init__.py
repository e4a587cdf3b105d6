"""The encoder's Hugging Face mapping: transformers' BertModel, BertForMaskedLM and BertForPreTraining."""
