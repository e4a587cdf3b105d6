"""Embeddings benchmark: tessera-serve's POST /v1/embeddings vs sentence-transformers' `encode`,
same model directory, same texts, same batch size, same machine, same run.

Builds a random model directory at start (sentence-transformers files included): `--model qwen3`
(a causal LM shaped like a small Qwen3-Embedding: last-token pooling, normalized; default
d=256, 4 layers) or `--model bert` (MiniLM-L6's shape, d=384, 6 layers, mean pooling, normalized;
needs the encoder kind). Starts `tessera-serve` on it (engine in its own process, as users run
it), then per round, alternating which runs first:
  - tessera: the N texts sent as requests of `--batch` inputs, `--concurrency` in flight, through
    the openai client (base64, its default), with truncate_prompt_tokens -1 (cut at
    max_seq_length, as sentence-transformers cuts);
  - sentence-transformers: `SentenceTransformer(dir).encode(texts, batch_size=--batch)`.
Prints embeddings/s of each, the ratio tessera / sentence-transformers per round and its median,
and the cosine of the two systems' vectors (the same numbers, or the comparison means nothing).

    .venv/bin/python benchmarks/embeddings.py --model qwen3 --texts 512 --batch 32 --rounds 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def corpus_texts(n: int, seed: int = 0) -> list[str]:
    """n texts of 8-120 words cut from the standard library's sources (what tests train on too)."""
    import random

    words = " ".join(inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder, argparse)).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(8, 120)
        start = rng.randrange(len(words) - k)
        out.append(" ".join(words[start:start + k]))
    return out


def _st_files(d: Path, mode: str, dim: int, max_len: int) -> None:
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (d / "1_Pooling").mkdir()
    (d / "2_Normalize").mkdir()
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, **{v: k == mode for k, v in keys.items()}, "include_prompt": True}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}))


def build_qwen3(d: Path, hidden: int, layers: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_texts(2000, seed=1), trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=eos)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    _st_files(d, "lasttoken", hidden, 512)


def build_bert(d: Path, hidden: int, layers: int) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import BertConfig, BertModel

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus_texts(2000, seed=1), trainers.WordPieceTrainer(vocab_size=8192, special_tokens=special))
    tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                            special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, intermediate_size=hidden * 4, max_position_embeddings=512)
    BertModel(cfg).eval().save_pretrained(d, safe_serialization=True)
    _st_files(d, "mean", hidden, 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tessera(url: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, list[list[float]]]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        # Cut at max_seq_length as sentence-transformers does (without it a longer text is a 400).
        replies = list(pool.map(lambda c: client.embeddings.create(model="m", input=c,
                                                                   extra_body={"truncate_prompt_tokens": -1}), chunks))
    seconds = time.perf_counter() - start
    return seconds, [d.embedding for r in replies for d in r.data]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["qwen3", "bert"], default="qwen3")
    p.add_argument("--hidden", type=int, default=None, help="Width (default: 256 qwen3, 384 bert).")
    p.add_argument("--layers", type=int, default=None, help="Layers (default: 4 qwen3, 6 bert).")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="Inputs per request, and sentence-transformers' batch_size.")
    p.add_argument("--concurrency", type=int, default=1, help="Requests in flight to tessera-serve.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--tensor-parallel", type=int, default=1, help="tessera-serve's --tensor-parallel (worker processes).")
    args = p.parse_args()
    hidden = args.hidden or (256 if args.model == "qwen3" else 384)
    layers = args.layers or (4 if args.model == "qwen3" else 6)
    texts = corpus_texts(args.texts)
    with tempfile.TemporaryDirectory(prefix="tessera-embed-bench-") as tmp:
        d = Path(tmp) / f"{args.model}-embed"
        (build_qwen3 if args.model == "qwen3" else build_bert)(d, hidden, layers)
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(d), device="cpu")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()",
               "--checkpoint", str(d), "--port", str(port), "--quiet", "--served-model-name", "m",
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "256",
               "--tensor-parallel", str(args.tensor_parallel)]
        log = open(Path(tmp) / "serve.log", "w")
        server = subprocess.Popen(cmd, stderr=log, start_new_session=True)
        try:
            import httpx

            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    print(Path(log.name).read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
            print(Path(log.name).read_text().strip().splitlines()[-1][:400])
            params = sum(v.numel() for v in st[0].auto_model.state_dict().values())
            tokens = sum(len(x) for x in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"])
            print(f"model: {args.model} d={hidden} L={layers} ({params / 1e6:.1f}M params), tensor parallel "
                  f"{args.tensor_parallel}, {len(texts)} texts "
                  f"({tokens} tokens), batch {args.batch}, concurrency {args.concurrency}, torch threads here "
                  f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
            run_tessera(url, texts[:64], args.batch, args.concurrency)  # warm-up
            st.encode(texts[:64], batch_size=args.batch)
            ratios = []
            for r in range(args.rounds):
                order = ["tessera", "st"] if r % 2 == 0 else ["st", "tessera"]
                rates = {}
                for who in order:
                    if who == "tessera":
                        seconds, ours = run_tessera(url, texts, args.batch, args.concurrency)
                    else:
                        start = time.perf_counter()
                        theirs = st.encode(texts, batch_size=args.batch, convert_to_tensor=True)
                        seconds = time.perf_counter() - start
                    rates[who] = len(texts) / seconds
                cos = torch.nn.functional.cosine_similarity(torch.tensor(ours, dtype=torch.float64),
                                                            theirs.double(), dim=-1).min().item()
                ratios.append(rates["tessera"] / rates["st"])
                print(f"round {r + 1} ({' first, '.join(order)} second): tessera-serve {rates['tessera']:.1f} "
                      f"embeddings/s, sentence-transformers {rates['st']:.1f}: ratio {ratios[-1]:.2f}x "
                      f"(min cosine {cos:.6f}, load average {os.getloadavg()[0]:.1f})")
            print(f"median ratio tessera-serve / sentence-transformers: {statistics.median(ratios):.2f}x")
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
