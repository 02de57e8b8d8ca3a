"""``scripts/bench/adapters``: full fine-tuning against LoRA (and QLoRA where CUDA is), side
by side on one Llama-shaped model built from a config (random weights, saved once as a
bf16 folder, as a downloaded model is).

Each mode runs in a fresh process (so its peak memory is its own): ttpeer's ``InnerTrainer``
over ``hf_causal_lm`` trains ``--steps`` batches, then the round's delta is encoded as a
peer sends it (8 bits). Printed per mode: trainable parameters, peak memory (the process's
resident set; on CUDA also the device's peak allocation), bytes a round (the encoded
delta), steps/s; and, in one more process, ttpeer's LoRA steps in turns with the same
model and batches in a bare PEFT loop (``peft`` and ``torch.optim.AdamW``, nothing of
ttpeer), for the steps/s ratio. Targets: LoRA's bytes a
round <= 1% of full fine-tuning's, its peak memory <= 0.4x, its steps/s within 1.3x of
the bare loop's.

The fit check's figures for a shape too big for this machine (``--estimate 8b``: a
Llama-3.1-8B-shaped config on a 24 GB card) come from ``ttpeer.train.fit_batch`` on the
meta device: nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # ~0.5B: fits a full fine-tune (16 B/param) in this machine's 23 GB; "1b" is the size.
    "0.5b": {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 32000},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
}
TASK = """from ttpeer.tasks import LoRA, hf_causal_lm


def task():
    return hf_causal_lm({base!r}, data={data!r}, block_size={block}, tokenizer="bytes", lora={lora})
"""


def make_base(folder: Path, shape: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder / "base")
    (folder / "data").mkdir()
    text = " ".join(f"line {i} of the benchmark's text, plain words and numbers {i * 7 % 1000}" for i in range(4000))
    (folder / "data" / "corpus.txt").write_text(text)


def run_one(mode: str, folder: Path, block: int, batch: int, steps: int) -> dict[str, Any]:
    """One mode in this process: what it prints as JSON for the table."""
    import torch

    from ttpeer import train

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lora = {"full": "None", "lora": "LoRA(r=16, alpha=32, dropout=0.05)",
            "qlora": "LoRA(r=16, alpha=32, dropout=0.05, base_bits=4)"}.get(mode, "LoRA(r=16, alpha=32, dropout=0.05)")
    task_file = folder / f"{mode}.py"
    task_file.write_text(TASK.format(base=str(folder / "base"), data=str(folder / "data"), block=block, lora=lora))
    task = train.load_task(str(task_file), folder)
    batches = [list(range(i * batch, (i + 1) * batch)) for i in range(steps + 1)]
    if mode == "speed":
        return _speed(task, batches, device)
    trainer = train.InnerTrainer(task, lr=2e-4, device=device, seed=0)
    base = train.init_state(task, 0)
    trainer.start(base)
    trainer.train_shard(batches[:1])  # warm-up: allocations, kernels
    began = time.perf_counter()
    trainer.train_shard(batches[1:])
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - began
    delta = trainer.delta(base)
    sent = len(train.encode_delta(delta, None, bits=8)[0])
    trainable, total = train.parameter_counts(trainer.model)
    return {"mode": mode, "trainable": trainable, "params": total, "steps_per_s": steps / took,
            "bytes_round": sent, "peak_rss": _peak_rss(), "peak_device": _peak_device(device)}


def _speed(task: Any, batches: list[list[int]], device: str, rounds: int = 3) -> dict[str, Any]:
    """Steps/s of ttpeer's inner loop and of a bare PEFT loop (the same LoRA model, batches,
    AdamW and loss, nothing of ttpeer), in turns in this one process, so both see the same
    machine: ``rounds`` turns each, the median of each side's per-step times."""
    import statistics

    import torch

    from ttpeer import train
    from ttpeer.train._spec import fetch_batch

    trainer = train.InnerTrainer(task, lr=2e-4, device=device, seed=0)
    trainer.start(train.init_state(task, 0))
    torch.manual_seed(0)
    model = task.spec.model().to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.01)

    def bare(indices: list[int]) -> None:
        x, y = fetch_batch(task.train, indices)
        task.spec.loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(run: Any) -> float:
        began = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) / (len(batches) - 1)

    bare(batches[0])
    trainer.train_shard(batches[:1])  # warm-up: allocations, kernels
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(timed(lambda: trainer.train_shard(batches[1:])))
        theirs.append(timed(lambda: [bare(b) for b in batches[1:]]))
    return {"mode": "speed", "ttpeer_steps_per_s": 1 / statistics.median(ours),
            "bare_steps_per_s": 1 / statistics.median(theirs), "rounds": rounds}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_device(device: str) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else 0


def estimate(shape: str, block: int, batch: int) -> list[dict[str, Any]]:
    """The fit check's figures for ``shape`` on a 24 GB card (23 GiB free), as if on CUDA."""
    from unittest import mock

    import torch

    from ttpeer import train
    from ttpeer.tasks import LoRA, hf_causal_lm
    from ttpeer.train._tasks import _validate

    rows = []
    # As on a CUDA peer with the extras: the base at its dtype, bitsandbytes there.
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch("ttpeer.train._fit.qlora_problem", return_value=None):
        from transformers import LlamaConfig

        LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, dtype="bfloat16",
                    tie_word_embeddings=False).save_pretrained(Path(tmp) / "base")
        (Path(tmp) / "d.txt").write_text("x" * (24 * block))
        for name, lora, ckpt in (("full", None, True), ("lora", LoRA(), True), ("qlora", LoRA(base_bits=4), True),
                                 ("lora, no checkpointing", LoRA(), False)):
            spec = hf_causal_lm(Path(tmp) / "base", Path(tmp) / "d.txt", block_size=block, tokenizer="bytes",
                                lora=lora)
            task = _validate(spec, name="estimate", origin="estimate", source_hash="0" * 64, slowdown=0)
            fit = train.fit_batch(task, batch_size=batch, device="cuda:0", device_free=23 << 30,
                                  host_free=28 << 30, shards=8, overlap=True, checkpointing=ckpt)
            rows.append({"mode": name, "device": fit.need.device, "base": fit.need.model,
                         "micro_batch": None if fit.misfit else fit.micro_batch,
                         "trainable": fit.need.params, "params": fit.need.total_params})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench/adapters", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the measured model (default 0.5b)")
    ap.add_argument("--block", type=int, default=128, help="tokens a sample (default 128)")
    ap.add_argument("--batch", type=int, default=2, help="samples a step (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps a mode (default 3)")
    ap.add_argument("--estimate", choices=sorted(SHAPES), default="8b",
                    help="the shape whose fit-check figures are printed (default 8b: 1024 tokens, batch 8)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode in this process
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.folder, args.block, args.batch, args.steps)))
        return 0
    import torch

    modes = ["full", "lora", "speed"] + (["qlora"] if torch.cuda.is_available() else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ttpeer-adapters-") as tmp:
        make_base(Path(tmp), args.shape)
        for mode in modes:
            out = subprocess.run([sys.executable, "-m", "bench.adapters", "--one", mode, "--folder", tmp,
                                  "--block", str(args.block), "--batch", str(args.batch), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    _print(rows, args)
    fits = estimate(args.estimate, 1024, 8)
    _print_fits(fits, args.estimate)
    if args.json:
        args.json.write_text(json.dumps({"measured": rows, "estimated": fits}, indent=2) + "\n")
    return 0


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by = {r["mode"]: r for r in rows}
    gib = 1 << 30
    print(f"{args.shape} Llama-shaped model, bf16 base folder, batch {args.batch} x {args.block} tokens, "
          f"{args.steps} timed steps, 8-bit deltas; device: {'cuda' if by['full']['peak_device'] else 'cpu'}")
    print(f"{'mode':<8} {'trainable':>14} {'peak RSS':>10} {'peak GPU':>10} {'bytes/round':>13} {'steps/s':>8}")
    for r in rows:
        if r["mode"] == "speed":
            continue
        print(f"{r['mode']:<8} {r['trainable']:>14,} {r['peak_rss'] / gib:>9.2f}G {r['peak_device'] / gib:>9.2f}G "
              f"{r['bytes_round']:>13,} {r['steps_per_s']:>8.3f}")
    full, lora, speed = by["full"], by["lora"], by["speed"]
    peak = "peak_device" if full["peak_device"] else "peak_rss"
    print(f"LoRA / full: bytes a round {lora['bytes_round'] / full['bytes_round']:.4f} (target <= 0.01), "
          f"peak memory {lora[peak] / full[peak]:.2f}x (target <= 0.4)")
    print(f"LoRA steps/s, in turns in one process ({speed['rounds']} turns of {args.steps} steps each, medians): "
          f"ttpeer {speed['ttpeer_steps_per_s']:.3f}, a bare PEFT loop {speed['bare_steps_per_s']:.3f}: "
          f"ttpeer's steps take {speed['bare_steps_per_s'] / speed['ttpeer_steps_per_s']:.2f}x as long "
          "(target <= 1.3)")


def _print_fits(rows: list[dict[str, Any]], shape: str) -> None:
    gib = 1 << 30
    print(f"\nthe fit check, {shape} Llama-shaped, 1024 tokens x batch 8, a card with 23 GiB free "
          "(--checkpointing but where said):")
    for r in rows:
        fits = f"micro-batches of {r['micro_batch']}" if r["micro_batch"] else "declines"
        print(f"  {r['mode']:<24} trainable {r['trainable']:>13,} of {r['params']:,}: needs "
              f"{r['device'] / gib:6.1f} GiB (base {r['base'] / gib:.1f}): {fits}")


if __name__ == "__main__":
    sys.exit(main())
