"""The vision-language kind's training hooks: image-text batches, the answer-token loss, freezing."""
