"""GPU evidence for gpu_engine, in one prepared script (torch + numpy only; no pytest).

Run on a CUDA machine from the repository root::

    python benchmarks/gpu_check.py            # checks + decode benchmark (a few minutes)
    python benchmarks/gpu_check.py --quick    # checks + batch 1 and 64 only

It prints one line per check (PASS/FAIL with the measured number) and then a
table, and exits non-zero if a check failed:

1. **paged attention**: the Triton kernel vs. the torch fallback on mixed
   batches (prefill chunks + decodes, scattered block tables) for fp32 and
   bf16, block sizes 16/32, head dims 64/128; max |Δ| within
   :data:`gpu_engine.attention.TOLERANCE`.
2. **scheduler on CUDA**: the tensor scheduler on the GPU makes exactly the
   CPU engine's decisions (``exact`` level) on random traces, and the spec's
   when :mod:`spec.scheduler` imports.
3. **model mode on CUDA**: the tiny Llama through Triton paged attention (fp32,
   TF32 off) samples the CPU engine's greedy tokens.
4. **decode benchmark**: a Llama-3.2-1B-shaped model (16 layers, hidden 2048,
   32 heads / 8 KV heads, head_dim 64, vocab 128256, tied) with random bf16
   weights, one decode step of batch 1, 64 and 256 at 1024 tokens of context,
   vs. the HBM bound ``(weight bytes + KV bytes read) / 4.8 TB/s``.
5. **scheduler step on the GPU**: scheduler-only decode steps (64/256/1024
   running) with the state in CUDA tensors vs. numpy views on the CPU.

Also runs the CUDA-only pytest tests when pytest and hypothesis are installed.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from spec.formats import Trace, TraceRequest  # noqa: E402
from spec.protocol import StepLimitError, drive  # noqa: E402

from gpu_engine import GpuEngine, LlamaConfig, PagedLlama  # noqa: E402
from gpu_engine.attention import TOLERANCE, paged_attention_torch, paged_attention_triton, triton  # noqa: E402
from gpu_engine.model import AttentionMetadata, param_shapes  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
DEVICE = "cuda"  # --device cpu: a dry run of this script's code paths (Triton via TRITON_INTERPRET=1)
FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


# ----------------------------------------------------------------------------- 1. attention


def mixed_batch(g, lens, starts, block_size, num_blocks, kvh, d, h, dtype, device):
    """Queries of several sequences (chunks and decodes) over a shuffled paged cache."""
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(device, dtype)
    perm, used, tables = torch.randperm(num_blocks, generator=g), 0, []
    width = max(-(-L // block_size) for L in lens)
    for L in lens:
        nb = -(-L // block_size)
        tables.append(torch.cat([perm[used:used + nb], torch.zeros(width - nb, dtype=torch.long)]))
        used += nb
    nq = [L - s for L, s in zip(lens, starts)]
    q = torch.randn(sum(nq), h, d, generator=g).to(device, dtype)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(nq))
    pos = torch.cat([torch.arange(s, L) for L, s in zip(lens, starts)])
    meta = dict(block_table=torch.stack(tables).to(device), seq_start=torch.tensor(starts, device=device),
                query_start=torch.tensor([0] + list(torch.tensor(nq).cumsum(0)), device=device),
                seq_lens=torch.tensor(lens, device=device), token_seq=seq.to(device, torch.int32),
                token_pos=pos.to(device, torch.int32))
    return q, k_cache, v_cache, meta


def check_attention(small: bool = False) -> None:
    if triton is None:
        report("paged attention", False, "triton is not importable")
        return
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for bs, d, h, kvh in ((16, 64, 32, 8), (32, 128, 8, 8), (16, 64, 12, 4)):
            lens = [1, 17, 300, 1024, 40, 700] if not small else [1, 17, 30, 9]
            starts = [0, 0, 290, 1023, 39, 500] if not small else [0, 0, 28, 8]  # prefills, chunks, decodes
            q, kc, vc, m = mixed_batch(g, lens, starts, bs, 256, kvh, d, h, dtype, DEVICE)
            scale = 1 / math.sqrt(d)
            want = paged_attention_torch(q, kc, vc, m["block_table"], m["seq_start"], m["query_start"],
                                         m["seq_lens"], scale)
            got = paged_attention_triton(q, kc, vc, m["block_table"], m["token_seq"], m["token_pos"], scale)
            err = (got.float() - want.float()).abs().max().item()
            report(f"paged attention {str(dtype)[6:]} bs={bs} d={d} h={h}/{kvh}", err <= TOLERANCE[dtype],
                   f"max |Δ| = {err:.2e} (tolerance {TOLERANCE[dtype]:.0e})")


# ----------------------------------------------------------------------------- 2./3. engine


def random_trace(seed: int, vocab: int = 1000) -> Trace:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    cfg = {"profile": "vllm-v1", "block_size": bs, "num_blocks": rng.randint(4, 60),
           "max_num_batched_tokens": rng.choice([8, 32, 256]), "max_num_seqs": rng.randint(1, 8),
           "max_model_len": 128, "policy": rng.choice(["fcfs", "priority"]),
           "enable_prefix_caching": rng.random() < 0.7, "long_prefill_token_threshold": rng.choice([0, 8]),
           "watermark": rng.choice([0.0, 0.1]), "max_steps": 400}
    reqs = []
    for i in range(rng.randint(1, 12)):
        p = rng.randint(1, 100)
        reqs.append(TraceRequest(id=f"r{i}", prompt_len=p, max_tokens=rng.randint(1, 20),
                                 arrival_step=rng.randint(0, 8), prefix_group="g" if rng.random() < 0.5 else None,
                                 prefix_len=rng.randint(0, p), priority=rng.randint(0, 2),
                                 ignore_eos=rng.random() < 0.5,
                                 abort_at=rng.randint(0, 15) if rng.random() < 0.1 else None))
    return Trace(config=cfg, requests=reqs, vocab_size=vocab, eos_token_id=2)


def replay(engine, trace):
    try:
        return drive(engine, trace, 400)
    except StepLimitError as e:
        return e.records


def logs(records, level="exact"):
    return [{k: v for k, v in r.to_json(level).items() if k != "reasons"} for r in records]


def check_scheduler(n: int) -> None:
    try:
        from spec.scheduler import SpecEngine
    except Exception:  # noqa: BLE001
        SpecEngine = None
    bad_cpu = bad_spec = 0
    t_gpu = t_cpu = 0.0
    for seed in range(n):
        trace = random_trace(seed)
        t0 = time.perf_counter()
        gpu = logs(replay(GpuEngine.from_trace(trace, device=DEVICE), trace))
        t1 = time.perf_counter()
        cpu = logs(replay(GpuEngine.from_trace(trace), trace))
        t2 = time.perf_counter()
        t_gpu, t_cpu = t_gpu + t1 - t0, t_cpu + t2 - t1
        bad_cpu += gpu != cpu
        if SpecEngine is not None:
            bad_spec += gpu != logs(replay(SpecEngine.from_trace(trace), trace))
    report("scheduler on CUDA == on CPU (exact)", bad_cpu == 0,
           f"{n - bad_cpu}/{n} traces agree ({t_gpu:.1f} s on CUDA, {t_cpu:.1f} s on CPU)")
    if SpecEngine is not None:
        report("scheduler on CUDA == spec (exact)", bad_spec == 0, f"{n - bad_spec}/{n} traces agree")


def tokens(records):
    out: dict[str, list[int]] = {}
    for r in records:
        for rid, t in r.sampled.items():
            out.setdefault(rid, []).append(t)
    return out


def check_model_mode(n: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    agree = total = 0
    for seed in range(n):
        trace = random_trace(100 + seed, vocab=512)
        engine = GpuEngine.from_trace(trace, device=DEVICE, model="tiny")
        if triton is not None:
            engine.model.attention_backend = "triton"  # (the default on CUDA; forced for a dry run)
        gpu = tokens(replay(engine, trace))
        cpu = tokens(replay(GpuEngine.from_trace(trace, model="tiny"), trace))
        total += len(cpu)
        agree += sum(gpu.get(r) == t for r, t in cpu.items())
    report("model mode on CUDA (Triton) == CPU greedy tokens", agree == total,
           f"{agree}/{total} requests with identical token streams (fp32, TF32 off)")


# ----------------------------------------------------------------------------- 4. decode benchmark


LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_weights(c: LlamaConfig, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    out = {}
    for name, shape in param_shapes(c).items():
        w = torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32)
        out[name] = (1 + 0.1 * w if name.endswith("norm.weight") else w / math.sqrt(shape[-1])).to(dtype)
    return out


def bench_decode(batches, context: int = 1024, iters: int = 20, c: LlamaConfig = LLAMA_1B) -> None:
    model = PagedLlama(c, random_weights(c), device=DEVICE, dtype=torch.bfloat16)
    bs = 16
    per_seq = -(-(context + 1) // bs)
    model.allocate_kv_cache(num_blocks=max(batches) * per_seq + 1, block_size=bs)
    model.kv_cache.normal_()
    n_params = sum(math.prod(s) for s in param_shapes(c).values())
    weight_bytes = 2 * n_params
    print("\n| batch | context | step ms | HBM bound ms | bound/step | tokens/s |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        table = (torch.arange(b * per_seq, device=DEVICE).view(b, per_seq) + 1)
        pos = torch.full((b,), context, device=DEVICE)
        meta = AttentionMetadata(block_table=table, seq_start=pos, query_start=torch.arange(b + 1, device=DEVICE),
                                 seq_lens=pos + 1, token_seq=torch.arange(b, device=DEVICE, dtype=torch.int32),
                                 token_pos=pos.to(torch.int32))
        ids = torch.randint(3, c.vocab_size, (b,), device=DEVICE)
        slots = table[torch.arange(b, device=DEVICE), pos // bs] * bs + pos % bs
        rows = torch.arange(b, device=DEVICE)
        for _ in range(3):
            model.forward(ids, pos, slots, meta, rows)
        sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            model.forward(ids, pos, slots, meta, rows).argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
        step = sorted(times)[len(times) // 2]
        kv_bytes = b * (context + 1) * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
        bound = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
        print(f"| {b} | {context} | {step * 1e3:.3f} | {bound * 1e3:.3f} | {bound / step:.2f} | {b / step:,.0f} |",
              flush=True)


def bench_scheduler(sizes=(64, 256, 1024), steps: int = 30) -> None:
    """Scheduler-only decode steps with the state on the GPU vs. on the CPU (numpy views)."""
    from bench_overhead import decode_trace

    print("\n| running | scheduler step ms (cuda) | (cpu) |")
    print("|---|---|---|")
    for r in sizes:
        trace = decode_trace(r, steps)
        row = []
        for device in (DEVICE, "cpu"):
            e = GpuEngine.from_trace(trace, device=device, level="decisions")
            for req in trace.requests:
                e.add_request(req)
            for _ in range(300):
                e.step()
                s = e.sched
                if len(s.running) == r and not s.num_waiting and bool(
                        (s.num_tokens[s.running] - s.num_computed_tokens[s.running] == 1).all()):
                    break
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                e.step()
                times.append(time.perf_counter() - t0)
            row.append(sorted(times)[len(times) // 2] * 1e3)
        print(f"| {r} | {row[0]:.3f} | {row[1]:.3f} |", flush=True)


def run_cuda_tests() -> None:
    """The CUDA-only tests of tests/test_gpu_*.py, when pytest (and the test deps) are here."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("pytest") is None or importlib.util.find_spec("hypothesis") is None:
        print("SKIP  pytest CUDA tests: pytest/hypothesis not installed (the checks below cover them)")
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-k", "cuda", "tests/test_gpu_engine_diff.py",
                        "tests/test_gpu_model.py"], cwd=root, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    report("pytest CUDA tests", r.returncode == 0, last)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--traces", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cpu = dry run of the script (tiny sizes)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    if DEVICE == "cpu":  # dry run: small sizes, same code
        check_attention(small=True)
        check_scheduler(3)
        check_model_mode(1)
        bench_decode([1, 4], context=64, iters=2, c=LlamaConfig(vocab_size=1000, num_hidden_layers=2))
        bench_scheduler((16,), steps=5)
        return 1 if FAILED else 0
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', 'absent')}")
    check_attention()
    run_cuda_tests()
    check_scheduler(args.traces // (4 if args.quick else 1))
    check_model_mode(4 if args.quick else 10)
    bench_decode([1, 64] if args.quick else [1, 64, 256])
    bench_scheduler((64, 256) if args.quick else (64, 256, 1024))
    print(f"\n{len(FAILED)} check(s) failed: {FAILED}" if FAILED else "\nall checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
