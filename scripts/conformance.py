#!/usr/bin/env python3
"""Golden exports through the engines' own config and setup code (issue 27).

`check --engine E --version V` runs inside that engine's virtual environment (made by
scripts/conformance.sh) and writes one JSON result per golden export of E's kind:
accepted (the engine's own parser / config classes / setup took it) and meaning kept
(what the engine derived equals the golden plan: parallel degrees, data-parallel size,
global batch and micro-batches, layer split over pipeline stages, recompute).

`report` prints the table and, with --record FILE, writes the results keyed by each
export's sha256 (the snapshot body) for the drift test.

No GPU is used. Stubs (only what needs CUDA): none beyond the engines' own CPU paths:
  - torchtitan: ParallelDims is built without a device mesh (its _validate runs, the
    mesh build needs a process group per rank); the pipeline split is computed with the
    engine's own functions on the config's model with the plan's layer count.
  - DeepSpeed: DS_ACCELERATOR=cpu; the mpu the export's notes name is a small object
    whose data-parallel size is the one the file states (DeepSpeedConfig reads only that).
  - Megatron: Megatron-LM's argument parser is not on the registry; the script's flags are
    mapped to megatron-core's TransformerConfig (its __post_init__ checks) and the layout
    is read by megatron-core's PipelineParallelLayerLayout.
"""

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import sys
import tempfile
import traceback

KIND = {
    ("torchtitan", "0.2"): "torchtitan-0.2.2",
    ("torchtitan", "0.3"): "torchtitan",
    ("deepspeed", None): "deepspeed",
    ("megatron-core", None): "megatron",
    ("megatron-bridge", None): "nemo",
}


def kind_of(engine, version):
    series = ".".join(version.split(".")[:2])
    return KIND.get((engine, series)) or KIND[(engine, None)]


def snap_body(path):
    return open(path, encoding="utf-8").read().split("---\n", 2)[2]


def sha256(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def golden_exports(golden, kind):
    out = []
    for f in sorted(os.listdir(golden)):
        suffix = f".{kind}.snap"
        if f.endswith(suffix):
            out.append((f[: -len(suffix)], os.path.join(golden, f)))
    return out


def plan_of(golden, stem):
    return json.loads(snap_body(os.path.join(golden, "..", f"{stem}.snap")))


def plan_chunks(plan):
    """Decoder layers of each model chunk in model order (chunk k on rank k mod pp)."""
    chunks = []
    for s in plan["stages"]:
        for r in s["layers"]:
            a, _, b = r.partition("-")
            chunks.append(list(range(int(a), int(b or a) + 1)))
    return sorted(chunks)


def mismatch(facts):
    """facts: [(what, engine's, plan's)] -> the differing ones, as text."""
    return "; ".join(f"{w}: engine {g} != plan {p}" for w, g, p in facts if g != p)


def fqn_chunks(parts):
    return [[int(m.split(".")[1]) for m in p if m.startswith("layers.")] for p in parts]


# ------------------------------------------------------------------ torchtitan


def titan_check(path, stem, plan, version):
    L = plan["layout"]
    n_layers = plan["inputs"]["model"]["num_layers"]
    world = L["tp"] * L["pp"] * L["dp"] * L["cp"] * L["ep"]
    from torchtitan.config import ConfigManager

    body = snap_body(path)
    with tempfile.TemporaryDirectory() as d:
        if version.startswith("0.2"):
            f = os.path.join(d, "job.toml")
            open(f, "w").write(body)
            cfg = ConfigManager().parse_args([f"--job.config_file={f}"])
        else:
            open(os.path.join(d, "shardwright_plan.py"), "w").write(body)
            sys.path.insert(0, d)
            sys.modules.pop("shardwright_plan", None)
            try:
                cfg = ConfigManager().parse_args(
                    ["--module", "shardwright_plan", "--config", "shardwright_plan"]
                )
            finally:
                sys.path.remove(d)
    par, tr = cfg.parallelism, cfg.training
    from torchtitan.distributed import ParallelDims

    kw = dict(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        cp=par.context_parallel_degree,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        ep=par.expert_parallel_degree,
        world_size=world,
    )
    if version.startswith("0.2"):
        kw["etp"] = par.expert_tensor_parallel_degree
    else:
        kw["spmd_backend"] = par.spmd_backend
    pd = ParallelDims(**kw)
    batch = pd.dp_replicate * pd.dp_shard
    glob = tr.global_batch_size if tr.global_batch_size > 0 else tr.local_batch_size * batch
    if pd.pp > 1:
        micro = tr.local_batch_size // par.pipeline_parallel_microbatch_size
        accum = glob // (tr.local_batch_size * batch)
        steps = micro * accum
    else:
        steps = glob // (tr.local_batch_size * batch)
    facts = [
        ("tp", pd.tp, L["tp"]),
        ("pp", pd.pp, L["pp"]),
        ("cp", pd.cp, L["cp"]),
        ("ep", pd.ep, L["ep"]),
        ("data-parallel ranks", batch, L["dp"] * L["ep"]),
        ("global batch", glob, plan["inputs"]["training"]["global_batch"]),
        ("micro-batch", par.pipeline_parallel_microbatch_size if pd.pp > 1 else tr.local_batch_size, L["micro_batch"]),
        ("micro-batches per step", steps, L["grad_accum"]),
        ("recompute", titan_recompute(cfg, version), L["recompute"]),
    ]
    if version.startswith("0.3"):
        facts.append(("sequence parallel", par.enable_sequence_parallel and pd.tp > 1, L["sequence_parallel"] and L["tp"] > 1))
    if pd.pp > 1:
        facts.append(("layer split", titan_split(pd, par, n_layers, version), plan_chunks(plan)))
    return mismatch(facts)


def titan_recompute(cfg, version):
    ac = cfg.activation_checkpoint
    if version.startswith("0.2"):
        return ac.mode
    if ac is None:
        return "none"
    return {"FullAC": "full", "SelectiveAC": "selective"}.get(
        type(ac).__qualname__.split(".")[0], type(ac).__qualname__
    )


def titan_split(pd, par, n_layers, version):
    """The model chunks torchtitan's own pipeline code makes for an n-layer model."""
    import torchtitan.distributed.pipeline_parallel as ppmod

    if version.startswith("0.3"):
        model = type("M", (), {"layers": [None] * n_layers})()
        stages, n, first, last = ppmod._get_pipeline_metadata(pd, par, model)
        parts = par.module_fqns_per_model_part or ppmod._generate_llm_fqn_per_model_part(
            stages, n, first, last
        )
        return fqn_chunks(parts)
    # 0.2.2: pipeline_llm's stage count (inline there), then its generator.
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
    first = par.pipeline_parallel_first_stage_less_layers
    last = par.pipeline_parallel_last_stage_less_layers
    if par.module_fqns_per_model_part:
        return fqn_chunks(par.module_fqns_per_model_part)
    lps = par.pipeline_parallel_layers_per_stage
    if lps is not None:
        stages = math.ceil((n_layers + first + last) / lps)
        spr = stages // pd.pp
        if stages % pd.pp or (single and spr != 1) or (not single and spr < 2):
            raise ValueError(f"pipeline_llm refuses {stages} stages over pp {pd.pp}")
    else:
        stages = pd.pp * (1 if single else 2)
    return fqn_chunks(ppmod.generate_llm_fqn_per_model_part(stages, n_layers, first, last))


# ------------------------------------------------------------------ DeepSpeed


def deepspeed_check(path, stem, plan, version):
    L = plan["layout"]
    body = snap_body(path)
    conf = json.loads(body)
    world = L["tp"] * L["pp"] * L["dp"] * L["cp"] * L["ep"]
    # The data-parallel size the file tells the launcher to hand DeepSpeed (its topology).
    dp = conf.get("_shardwright", {}).get("topology", {}).get("data", world)

    class Mpu:
        def get_data_parallel_world_size(self):
            return dp

        def get_data_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return world // dp

        def get_model_parallel_rank(self):
            return 0

    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    # Stub: DeepSpeedConfig reads the rank from the process group first and, with none
    # initialised (no GPUs here), silently falls back to world size 1 and ignores the mpu.
    deepspeed.comm.get_rank = lambda *a, **k: 0
    ds = DeepSpeedConfig(conf, mpu=Mpu())
    facts = [
        ("global batch", ds.train_batch_size, plan["inputs"]["training"]["global_batch"]),
        ("data-parallel size", dp, world // (L["tp"] * L["pp"])),
        ("zero stage", ds.zero_optimization_stage, L["zero_stage"]),
        (
            "pipeline full recompute",
            (conf.get("pipeline") or {}).get("activation_checkpoint_interval", 0) > 0,
            L["recompute"] == "full" and L["pp"] > 1,
        ),
    ]
    return mismatch(facts)


# ------------------------------------------------------------------ Megatron


def script_flags(body):
    """The flags of the script's NAME_ARGS=( ... ) arrays (not torchrun's)."""
    flags = {}
    for name, inner in re.findall(r"^(\w+)_ARGS=\(\n(.*?)^\)", body, re.S | re.M):
        if name == "DISTRIBUTED":
            continue
        words = shlex.split(inner, comments=True)
        i = 0
        while i < len(words):
            w = words[i]
            if w.startswith("--"):
                if i + 1 < len(words) and not words[i + 1].startswith("--"):
                    flags[w] = words[i + 1]
                    i += 2
                    continue
                flags[w] = True
            i += 1
    return flags


def bridge_overrides(body):
    """KEY=VALUE overrides of the run_recipe.py command."""
    out = {}
    for w in shlex.split(body, comments=True):
        m = re.match(r"^([a-z_]+(?:\.[a-z_]+)*)=(.*)$", w)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def transformer_config(kw, provider=False):
    """megatron-core's TransformerConfig (or, for Bridge, its GPTModelProvider, a subclass
    with the run fields such as seq_length) built from kw; __post_init__ checks it."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    cls = TransformerConfig
    if provider:
        try:
            from megatron.bridge.models.gpt_provider import GPTModelProvider as cls
        except ImportError:
            pass
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kw) - names)
    if unknown and cls is not TransformerConfig:
        raise TypeError(f"{cls.__name__} has no field {unknown}")
    return cls(**{k: v for k, v in kw.items() if k in names})


def megatron_layout(cfg, pp):
    """Decoder layers per virtual stage in model order, from megatron-core's layout."""
    lay = cfg.pipeline_model_parallel_layout
    if lay is None:
        return None
    stages = lay.layout  # [pp rank][vp stage] -> [layer types]
    vpp = len(stages[0])
    out = []
    for v in range(vpp):
        for r in range(pp):
            out.append(sum(1 for t in stages[r][v] if str(t).endswith("decoder")))
    return out


def megatron_facts(cfg, plan, world, mbs, gbs):
    L = plan["layout"]
    dp = world // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size)
    facts = [
        ("tp", cfg.tensor_model_parallel_size, L["tp"]),
        ("pp", cfg.pipeline_model_parallel_size, L["pp"]),
        ("cp", cfg.context_parallel_size, L["cp"]),
        ("data-parallel size", dp, L["dp"] * L["ep"]),
        ("micro-batches per step", gbs // (mbs * dp), L["grad_accum"]),
        ("micro-batch", mbs, L["micro_batch"]),
    ]
    if L["ep"] > 1:
        facts.append(("ep x expert tp", cfg.expert_model_parallel_size * (cfg.expert_tensor_parallel_size or 1), L["ep"] * L["tp"] if cfg.expert_tensor_parallel_size == 1 else L["ep"]))
    split = megatron_layout(cfg, cfg.pipeline_model_parallel_size)
    if split is not None:
        facts.append(("layer split", split, [len(c) for c in plan_chunks(plan)]))
    rc = "full" if cfg.recompute_granularity == "full" else ("selective" if cfg.recompute_granularity == "selective" else "none")
    facts.append(("recompute", rc, L["recompute"]))
    return facts


def megatron_check(path, stem, plan, version):
    f = script_flags(snap_body(path))
    L = plan["layout"]
    world = L["tp"] * L["pp"] * L["dp"] * L["cp"] * L["ep"]
    num = lambda k, d=None: int(f[k]) if k in f else d
    kw = dict(
        num_layers=num("--num-layers"),
        hidden_size=num("--hidden-size"),
        num_attention_heads=num("--num-attention-heads"),
        ffn_hidden_size=num("--ffn-hidden-size"),
        tensor_model_parallel_size=num("--tensor-model-parallel-size", 1),
        pipeline_model_parallel_size=num("--pipeline-model-parallel-size", 1),
        context_parallel_size=num("--context-parallel-size", 1),
        expert_model_parallel_size=num("--expert-model-parallel-size", 1),
        sequence_parallel="--sequence-parallel" in f,
        bf16="--bf16" in f,
        params_dtype=__import__("torch").bfloat16 if "--bf16" in f else __import__("torch").float32,
        pipeline_dtype=__import__("torch").bfloat16 if "--bf16" in f else None,
        gated_linear_unit="--swiglu" in f,
        add_bias_linear="--disable-bias-linear" not in f,
        normalization=f.get("--normalization", "LayerNorm"),
    )
    if "--expert-tensor-parallel-size" in f:
        kw["expert_tensor_parallel_size"] = num("--expert-tensor-parallel-size")
    if "--group-query-attention" in f:
        kw["num_query_groups"] = num("--num-query-groups")
    if "--kv-channels" in f:
        kw["kv_channels"] = num("--kv-channels")
    if "--pipeline-model-parallel-layout" in f:
        kw["pipeline_model_parallel_layout"] = f["--pipeline-model-parallel-layout"]
    elif "--num-layers-per-virtual-pipeline-stage" in f:
        kw["virtual_pipeline_model_parallel_size"] = kw["num_layers"] // (
            kw["pipeline_model_parallel_size"] * num("--num-layers-per-virtual-pipeline-stage")
        )
    if "--num-experts" in f:
        kw["num_moe_experts"] = num("--num-experts")
        kw["moe_router_topk"] = num("--moe-router-topk", 2)
        kw["moe_ffn_hidden_size"] = num("--moe-ffn-hidden-size")
        if "--moe-shared-expert-intermediate-size" in f:
            kw["moe_shared_expert_intermediate_size"] = num("--moe-shared-expert-intermediate-size")
        kw["moe_token_dispatcher_type"] = f.get("--moe-token-dispatcher-type", "allgather")
        if "--moe-flex-dispatcher-backend" in f:
            kw["moe_flex_dispatcher_backend"] = f["--moe-flex-dispatcher-backend"]
        if "--moe-layer-freq" in f:
            v = f["--moe-layer-freq"]
            kw["moe_layer_freq"] = eval(v) if v.startswith("(") or v.startswith("[") else int(v)
    if "--recompute-granularity" in f:
        kw["recompute_granularity"] = f["--recompute-granularity"]
        if "--recompute-method" in f:
            kw["recompute_method"] = f["--recompute-method"]
            kw["recompute_num_layers"] = num("--recompute-num-layers", 1)
    cfg = transformer_config(kw)
    return mismatch(megatron_facts(cfg, plan, world, num("--micro-batch-size"), num("--global-batch-size")))


def bridge_mixed_precision(name):
    """The model fields Bridge's `mixed_precision` recipe sets (MixedPrecisionConfig.setup).
    Bridge's package imports Transformer Engine (CUDA only), so on this machine its recipes
    are recorded from megatron/bridge/training/mixed_precision.py (0.6.2): a stub."""
    import torch

    try:
        import dataclasses

        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        mpc = get_mixed_precision_config(name)
        return {f.name: getattr(mpc, f.name) for f in dataclasses.fields(mpc)
                if f.name in ("bf16", "fp16", "params_dtype", "pipeline_dtype")}
    except ImportError:
        recorded = {
            "bf16_mixed": dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16),
            "fp16_mixed": dict(fp16=True, params_dtype=torch.half, pipeline_dtype=torch.half),
        }
        if name not in recorded:
            raise ValueError(f"mixed_precision={name}: not a recorded Bridge recipe")
        return recorded[name]


def bridge_check(path, stem, plan, version):
    ov = bridge_overrides(snap_body(path))
    L = plan["layout"]
    world = L["tp"] * L["pp"] * L["dp"] * L["cp"] * L["ep"]
    model = {k[len("model."):]: v for k, v in ov.items() if k.startswith("model.")}
    from omegaconf import OmegaConf

    def val(v):
        v = OmegaConf.create({"v": v.strip("'\"") if v.startswith(("'", '"')) else yaml_val(v)})["v"]
        return v

    kw = {k: val(v) for k, v in model.items()}
    kw.setdefault("num_layers", plan["inputs"]["model"]["num_layers"])
    kw.setdefault("hidden_size", plan["inputs"]["model"]["hidden_size"])
    kw.setdefault("num_attention_heads", plan["inputs"]["model"]["num_attention_heads"])
    # Bridge applies the `mixed_precision` recipe (bf16_mixed: bf16, params_dtype and
    # pipeline_dtype bf16) to the model provider before it is finalised; so does this.
    if "mixed_precision" in ov:
        kw.update(bridge_mixed_precision(val(ov["mixed_precision"])))
    cfg = transformer_config(kw, provider=True)
    mbs = int(ov.get("train.micro_batch_size", 1))
    gbs = int(ov["train.global_batch_size"])
    return mismatch(megatron_facts(cfg, plan, world, mbs, gbs))


def yaml_val(v):
    import yaml

    return yaml.safe_load(v)


CHECKS = {
    "torchtitan": titan_check,
    "deepspeed": deepspeed_check,
    "megatron-core": megatron_check,
    "megatron-bridge": bridge_check,
}


def check(args):
    kind = kind_of(args.engine, args.version)
    results = []
    for stem, path in golden_exports(args.golden, kind):
        plan = plan_of(args.golden, stem)
        rec = {"export": os.path.basename(path), "sha256": sha256(snap_body(path)), "engine": f"{args.engine} {args.version}"}
        try:
            wrong = CHECKS[args.engine](path, stem, plan, args.version)
            rec.update(accepted=True, meaning_kept=not wrong, detail=wrong or "")
        except Exception as e:  # the engine refused it: record its words
            msg = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            rec.update(accepted=False, meaning_kept=False, detail=" ".join(msg)[:400])
        print(f"{rec['engine']:24} {stem:36} accepted={rec['accepted']} meaning_kept={rec['meaning_kept']} {rec['detail'][:160]}", file=sys.stderr)
        results.append(rec)
    json.dump(results, open(args.out, "w"), indent=1, sort_keys=True)


def report(args):
    rows, records = [], {}
    for f in sorted(os.listdir(args.results)):
        res = json.load(open(os.path.join(args.results, f)))
        if not res:
            continue
        n = len(res)
        acc = sum(r["accepted"] for r in res)
        kept = sum(r["accepted"] and r["meaning_kept"] for r in res)
        rows.append((res[0]["engine"], f"{acc}/{n}", f"{kept}/{n}"))
        for r in res:
            e = records.setdefault(r["export"], {"sha256": r["sha256"], "engines": {}})
            e["engines"][r["engine"]] = {k: r[k] for k in ("accepted", "meaning_kept", "detail")}
    print("| engine/version | accepted | meaning kept |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    for name, e in sorted(records.items()):
        for eng, r in sorted(e["engines"].items()):
            if not (r["accepted"] and r["meaning_kept"]):
                print(f"  {name} ({eng}): {r['detail']}")
    if args.record:
        doc = {
            "about": "scripts/conformance.sh: each golden export (sha256 of its snapshot body) through each engine's own code",
            "engines": [r[0] for r in rows],
            "exports": dict(sorted(records.items())),
        }
        with open(args.record, "w") as fh:
            json.dump(doc, fh, indent=1, sort_keys=True)
            fh.write("\n")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--engine", required=True, choices=sorted(CHECKS))
    c.add_argument("--version", required=True)
    c.add_argument("--golden", required=True)
    c.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("--golden", required=True)
    r.add_argument("--results", required=True)
    r.add_argument("--record")
    a = ap.parse_args()
    check(a) if a.cmd == "check" else report(a)


if __name__ == "__main__":
    main()
