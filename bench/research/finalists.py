"""Which plans a finished run would confirm today: its finalists, chosen from its store by the current rule.

The finalist rule (``autotune.confirm.finalist_order``) can change after a run has ended; this writes, per store, the
``confirm.top_k`` plans it picks now as plan files, so they can be confirmed side by side with
``autotune evaluate --split holdout --plan FILE ...`` without building a search trial again.

Usage:
    python bench/research/finalists.py configs/minilm-cpu.yaml --stores b48/runs/ppo-s0/trials.sqlite greedy=greedy.sqlite \
        --out finalists
A run ranks with its FP32 profile's runtime shares, which agent runs keep in their store; ``--shares STORE`` lends
them to stores that keep none (a search's). It writes ``NAME-K.json`` (K = 0 is the first finalist; NAME is given
as ``NAME=PATH``, else the store's file name without its suffix, or its run directory's name for ``trials.sqlite``)
and ``finalists.json``: per store, each finalist's hash, search speedup, expected speedup and drop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.config.schema import load_config  # noqa: E402
from autotune.confirm import finalist_order  # noqa: E402
from autotune.harness.priors import lent_runtime_shares, stored_runtime_shares  # noqa: E402
from autotune.plan import Plan  # noqa: E402
from autotune.run.files import write_json  # noqa: E402
from autotune.run.store import TrialStore  # noqa: E402


def named_store(argument: str) -> tuple[str, Path]:
    """``NAME=PATH`` -> (NAME, PATH); ``runs/ppo-s0/trials.sqlite`` and ``stores/ppo-s0.sqlite`` -> ``ppo-s0``."""
    name, _, path = argument.rpartition("=")
    store = Path(path)
    return name or (store.parent.name if store.stem == "trials" else store.stem), store


def fp32_plan(store: TrialStore) -> Plan:
    """The run's FP32 reference plan, from its confirmation (a finished run confirms FP32 beside its finalists).

    Raises:
        SystemExit: The run never reached its confirmation.
    """
    fp32_hash = store.get_meta("fp32_plan_hash")
    confirmed = store.confirmations().get(str(fp32_hash)) if fp32_hash else None
    if confirmed is None:
        raise SystemExit(f"{store.path}: the run has not confirmed FP32 yet; finish it first (autotune resume)")
    return confirmed.plan


def finalists(
    name: str, store_path: Path, config_path: Path, out: Path, fallback_shares: dict[str, float] | None = None
) -> list[dict]:
    """Writes one store's finalists as plan files under ``out``; returns what ``finalists.json`` keeps of them.

    A run ranks its finalists with the FP32 profile; a store that keeps none (a search's) uses ``fallback_shares``,
    and without those is ranked as a run without a profile ranks.
    """
    config = load_config(config_path)
    with TrialStore(store_path) as store:
        fp32 = fp32_plan(store)
        measured = list(store.trials())
        shares = stored_runtime_shares(store) or fallback_shares
    trials = {t.plan_hash: t for t in measured}
    order, expected = finalist_order(measured, config.finalists, fp32, shares)
    chosen = order[: config.confirm.top_k]
    rows = []
    for index, plan in enumerate(chosen):
        write_json(out / f"{name}-{index}.json", plan.to_dict())
        trial = trials[plan.hash]
        rows.append(
            {
                "file": f"{name}-{index}.json",
                "hash": plan.hash,
                "speedup": trial.speedup,
                "expected": expected.get(plan.hash),
                "drop": trial.accuracy_drop,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--stores", type=named_store, nargs="+", required=True, help="[NAME=]PATH of a trials store")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shares", type=Path, help="a store whose FP32 profile ranks the stores that keep none")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        fallback = lent_runtime_shares(args.shares) if args.shares is not None else None
    except ValueError as error:
        parser.error(f"--shares {error}")
    table = {name: finalists(name, path, args.config, args.out, fallback) for name, path in args.stores}
    write_json(args.out / "finalists.json", table)
    for name, rows in table.items():
        print(name, " ".join(f"{row['hash'][:10]} ({row['expected']:.2f}x)" for row in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
