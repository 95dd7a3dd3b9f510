"""What a verify's logits processors cost: the penalties a request sets on all rows at once
(`speculation.processors.Penalty.rows`) against the same mlx-lm processors called row by row (the way
a caller's own processor runs), on one chain's verify rows; the outputs must be equal to the bit.

    python benchmarks/processors_cost.py --rows 16 --vocab 49152 --out benchmarks/results/<date>-processors-cost
"""

import argparse
import json
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
import numpy as np

from dflash_mlx.options import GenerationOptions
from dflash_mlx.speculation.processors import option_processors, process_batch, process_chain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import parts  # noqa: E402

SETS = {
    "repetition 1.1": dict(repetition_penalty=1.1),
    "repetition, presence, frequency, bias": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                                                  logit_bias={5: 1.0}),
}


def best_ms(fn, reps: int) -> float:
    return 1e3 * parts.best_call_seconds(fn, 20, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prior", type=int, default=300, help="tokens before the verify")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prior = [int(t) for t in rng.integers(0, args.vocab, args.prior)]
    fed = mx.array(rng.integers(0, args.vocab, (1, args.rows)).astype(np.int32))
    logits = mx.array(rng.standard_normal((1, args.rows, args.vocab)).astype(np.float32))
    mx.eval(fed, logits)
    results = []
    for name, fields in SETS.items():
        together = option_processors(GenerationOptions(**fields))
        one_by_one = [penalty.own for penalty in together]  # (plain callables: called row by row)
        a, b = process_chain(together, prior, fed, logits), process_chain(one_by_one, prior, fed, logits)
        assert mx.array_equal(a, b).item(), name
        row = dict(processors=name, all_rows_ms=best_ms(lambda: process_chain(together, prior, fed, logits), args.reps),
                   row_by_row_ms=best_ms(lambda: process_chain(one_by_one, prior, fed, logits), args.reps))
        results.append(row)
        print(f"{name}: {row['row_by_row_ms']:.2f} ms row by row, {row['all_rows_ms']:.2f} ms all rows at once "
              f"({args.rows} rows, vocabulary {args.vocab}, best of {args.reps} x 20)")
    # a batch: 8 rows of 4, every row under a repetition penalty of its own request (same settings)
    batch, width = 8, 4
    inputs = mx.array(rng.integers(0, args.vocab, (batch, width)).astype(np.int32))
    batch_logits = mx.array(rng.standard_normal((batch, width, args.vocab)).astype(np.float32))
    procs = [option_processors(GenerationOptions(repetition_penalty=1.1)) for _ in range(batch)]
    priors = [mx.array([int(t) for t in rng.integers(0, args.vocab, args.prior + 7 * b)], dtype=mx.int32)
              for b in range(batch)]
    mx.eval(inputs, batch_logits, priors)

    def each_alone():
        return mx.concatenate([process_chain(procs[b], priors[b], inputs[b : b + 1], batch_logits[b : b + 1])
                               for b in range(batch)])

    def together():
        return process_batch(procs, priors, inputs, batch_logits)

    assert mx.array_equal(each_alone(), together()).item()
    row = dict(processors=f"repetition 1.1, a batch of {batch} rows x {width}",
               all_rows_ms=best_ms(together, args.reps), row_by_row_ms=best_ms(each_alone, args.reps))
    results.append(row)
    print(f"{row['processors']}: {row['row_by_row_ms']:.2f} ms a row at a time, {row['all_rows_ms']:.2f} ms together")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        run = {"command": " ".join(sys.argv), "backend": str(mx.default_device()), "results": results}
        (out / "results.json").write_text(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
