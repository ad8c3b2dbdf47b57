"""What the text encoder costs a text-conditioned run, precomputed and not (issue 29, section 5).

A text-conditioned DiT (hidden 192, depth 6, 3 heads, patch 2: 256 image tokens, cross-attention to 32 caption tokens;
bf16 autocast) trains on the emoji at 32x32 in batches of BATCH with Islands' diffusion objective and AdamW, two ways
in turn, ROUNDS rounds of STEPS steps each: its captions' embeddings looked up in the table encoded once per run
(what `model.condition: text` does, and what shards from `islands encode --text-encoder` hold), or its captions
encoded by MiniLM-L6 at every step (what a loader without precomputed embeddings would do). Beside them: MiniLM's
cold load, its throughput at batch 32 and 256, and the one-time cost of the whole table (3,655 captions).

    python -m benchmarks text_encoder
"""

import time

import torch

from benchmarks.common import THREADS, autocast, cpu_seconds, median, others_share, save, setup, table
from islands.conditions import network_spec
from islands.config import validate
from islands.data import build_data
from islands.data.batch import Batch
from islands.data.captions import encode_captions
from islands.nets import build_network
from islands.nets.text_folder import bundled_text_encoder
from islands.train.objectives import build_objective

BATCH, STEPS, ROUNDS, TOKENS = 32, 10, 3, 32
MODEL = dict(arch="dit", patch_size=2, hidden_size=192, depth=6, num_heads=3, text_tokens=TOKENS)


def run() -> dict:
    setup()
    cfg = validate({"run_dir": "runs/benchmarks/text_encoder", "data": {"source": "emoji", "resolution": 32},
                    "model": MODEL, "train": {"label_dropout": 0.1}})
    source = build_data(cfg.data, cfg.seed)
    captions = source.captions(range(len(source)))
    start = time.perf_counter()
    encoder = bundled_text_encoder()
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    table_all = encode_captions(encoder, captions, TOKENS)
    table_s = time.perf_counter() - start
    throughput = {}
    for batch in (BATCH, 256):
        chunk = captions[:batch]
        encode_captions(encoder, chunk, TOKENS)  # warm
        start = time.perf_counter()
        for _ in range(3):
            encode_captions(encoder, chunk, TOKENS)
        throughput[batch] = 3 * batch / (time.perf_counter() - start)

    net = build_network(network_spec(cfg.model, tuple(source.shape), 0)).train()
    objective = build_objective(cfg)
    objective.prepare(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)

    def steps(encode: bool) -> float:
        """Seconds per image of STEPS training steps, the condition looked up or encoded at each."""
        start = time.perf_counter()
        for _ in range(STEPS):
            idx = torch.randint(len(source), (BATCH,), generator=gen)
            x, _ = source.get(idx.tolist())
            cond = (encode_captions(encoder, [captions[i] for i in idx.tolist()], TOKENS) if encode
                    else table_all[idx])
            batch = Batch(x, cond, idx)
            opt.zero_grad(set_to_none=True)
            with autocast("bf16"):
                loss = objective(net, batch).mean()
            loss.backward()
            opt.step()
        return (time.perf_counter() - start) / (STEPS * BATCH)

    steps(False)  # warm
    rounds, since = [], cpu_seconds()
    for r in range(ROUNDS):
        rounds.append({"precomputed": steps(False), "encoded each step": steps(True)})
        print(f"  round {r + 1}/{ROUNDS}: {1e3 * rounds[-1]['precomputed']:.1f} ms/img precomputed, "
              f"{1e3 * rounds[-1]['encoded each step']:.1f} ms/img encoding", flush=True)
    others = others_share(since)
    pre, fly = (median([m[k] for m in rounds]) for k in ("precomputed", "encoded each step"))
    rows = [["caption embeddings precomputed (a table lookup)", 1e3 * pre, 1.0],
            ["captions encoded by MiniLM-L6 at every step", 1e3 * fly, fly / pre]]
    print(table(["training step of the text DiT, bf16, batch 32", "ms per image", "vs precomputed"], rows))
    print(f"  MiniLM-L6: cold load {load_s:.1f} s; {throughput[BATCH]:.0f} captions/s at batch {BATCH}, "
          f"{throughput[256]:.0f} at 256 ({THREADS} threads); the table of all {len(captions)} captions "
          f"{table_s:.1f} s once ({1e3 * table_s / len(captions):.2f} ms per caption); other processes took "
          f"{others:.0%} of the CPUs")
    result = {"ms_per_image_precomputed": 1e3 * pre, "ms_per_image_encoding": 1e3 * fly, "ratio": fly / pre,
              "rounds": rounds, "encoder_load_s": load_s, "captions_per_s": throughput, "table_s": table_s,
              "captions": len(captions), "tokens": TOKENS, "batch": BATCH, "others_share": others,
              "met": fly / pre > 1.0}
    save("text_encoder", result)
    return result


if __name__ == "__main__":
    run()
