"""End-to-end generation speed and memory per precision: TTFT, TPOT, TTLT and memory of FP16
(mamba-ssm's own MambaLMHeadModel, and quamba's FP model on the same kernels), W8A8, W4A8 and
W4A16, at the shapes of a published Mamba size with random weights (no download) or of a real model.
A hybrid (--config nemotron-h-8b, falcon-h1-1.5b, zamba2-2.7b, granite-4.0-h-tiny, or a hybrid
--model) has two FP16 baselines: quamba's FP model (mamba-ssm's kernels for its Mamba layers, SDPA
attention) and transformers' own model of the family (SDPA attention; mamba-ssm's kernels when
installed), built from the same config.json with its own random weights; each ratio is to the
faster of them for its number (``ratio_baselines`` names which). A family that quamba does not
quantize yet has FP16 rows only (the notes say why).

    python benchmarks/profile_mamba.py --config 2.8b [--precisions fp16,w8a8,w4a8,w4a16]
        [--batch 1,8,32,64] [--prompt_len 1024] [--gen_len 128] [--repeats 10] [--breakdown]
        [--state_cache int8|fp32] [--lm_head fp16|int8|int4] [--fused_decode] [--op_by_op]
        [--out result.json]
    python benchmarks/profile_mamba.py --model state-spaces/mamba-130m ...

* TTFT: a prefill of prompt_len tokens that fills the decode cache and returns the last token's
  logits (eager; its kernels are long enough to hide the launches).
* TPOT: one decode step replayed from a CUDA graph (quamba.models.generation.GraphedStep; the same
  capture for mamba-ssm's model). A model whose decode the graphs refuse (a QuambaError: MoE
  layers, whose routing is read on the host), and transformers' model, decode eagerly: such a row records
  ``graphed: false`` and the reason (``graph_refusal``), and has no TTFT graph.
* TTFT graph (quamba rows): the same prefill replayed from its CUDA graph through
  quamba.models.generation.graphed_prefill, which generate(prefill_graph=True) runs
  (`ttft_graph_ms`, median of replays timed as TTFT), and its first, capturing call
  (`prefill_capture_ms`, wall time: warm-up prefill, capture, replay).
* prefill host time (every row): the host's time to issue one eager prefill while a sleep kernel
  queued first keeps the GPU busy (`prefill_host_ms`; `prefill_host_waited` when the GPU went idle
  before the host was done, making it an upper bound, and `prefill_sync` the first call torch
  reports as synchronizing in a prefill: benchmarks/common.py's first_sync). Against TTFT and the
  prefill kernels' time (--breakdown) it says where batch-1 TTFT goes.
* TTLT: the prefill and gen_len decode steps, the next token chosen greedily on the device.
* generate (quamba rows): the same through quamba's generate(cache_graph=True), eos ignored, which
  checks for eos every 8 tokens (its default; `generate_ms`) or after each (`generate_each_ms`).
Each is the median of --repeats runs timed with CUDA events after warm-up; tokens/s of decode
is batch / TPOT, of prefill batch · prompt_len / TTFT. --batch takes several sizes (1,8,32,64):
the whole run repeats per size, and the JSON then holds one run per size under "runs". Memory: the weights
(parameters and buffers, tied tensors once), the decode caches (SSM state and conv state apart,
also per sequence; --state_cache picks the quantized rows' SSM state format, --lm_head their head's:
quamba.layers.qhead, the float head by default), and the peak allocated during one
TTLT run with only that model on the GPU (the FP model waits on the CPU meanwhile). Ratios are to
the mamba-ssm row of the same run; without mamba-ssm, FP16 and W4A16 (whose conv and scan would
run as torch references) are skipped unless --reference_fp_ops is given, and the ratios are to
quamba's FP16 row where there is one. The decode floor is the weight bytes over the measured copy
bandwidth. Every row also records how long a graphed step's launch keeps the GPU waiting
(`graph_launch`). --breakdown adds the per-kernel GPU time of one eager decode step and one
prefill (torch profiler) for every row, and of the graphed decode step as replayed, with each
kernel's share of the critical path (programmatically dependent kernels overlap, so their own
times add up to more than the step) and the GPU's idle time between its kernels; the profiles run
in a child process after the timings.
Quantized models are calibrated on random tokens: their scales are meaningless, their speed is not.
--fused_decode adds, after each W8A8 and W4A8 row, the same model with its mixers' decode step's
SSM side run as one qmixer_ssm_step ("quamba w8a8 fused": QuantizedModel.set_fused_decode(True))
instead of op by op, so the two are compared on the same machine in the same run.
A W8A8, W4A8 or W4A16 model of Mamba-2.8B's sizes runs each block's batch-1 decode step as one
persistent kernel (qmamba_layer_step or w4a16_layer_step, QuantizedModel.set_fused_layer) where the
GPU allows, and a W4A16 model its mixers' decode-step SSM side as one kernel elsewhere at batch 1
and 2 (w4a16_ssm_step, QuantizedModel.set_fused_ssm_step); --op_by_op adds, after each W8A8, W4A8 and W4A16 row, the
same model with its blocks' steps op by op ("quamba w8a8 op-by-op").

Every quamba row records the backend of each op that ran in it (`backends`, from
quamba.ops.backend.recording). A quantized op that ran its torch reference on the GPU makes a
number that says nothing about the kernels: the script then prints which ops and why, and exits
with status 1 (`--allow_reference_ops` accepts it); FP ops on their references are allowed only
with --reference_fp_ops.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

from common import (check_backends, copy_bandwidth_gbs, first_sync, format_table,
                    graph_launch_timing, host_ms, median_ms, run_metadata, write_json)

from quamba import QuambaError, QuantConfig, quantize
from quamba.layers.qhead import LM_HEAD_FORMATS
from quamba.models.config import MambaConfig
from quamba.models.generation import GraphedStep, graphed_decoder, graphed_prefill
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.models.presets import HYBRID_PRESETS, PRESET_NAMES, build_preset
from quamba.models.state import AttentionState, MixerState
from quamba.ops import backend, fp_kernels
from quamba.quantization.config import STATE_CACHE_FORMATS

PRECISIONS = {"fp16": None, "w8a8": (8, 8), "w4a8": (4, 8), "w4a16": (4, 16)}
FP_MIXER = ("fp16", "w4a16")  # run mamba-ssm's conv and scan kernels, or their torch references
BASELINE = "mamba-ssm fp16"
TRANSFORMERS_BASELINE = "transformers fp16"
QUAMBA_FP16 = "quamba fp16"
TRANSFORMERS_REFUSAL = ("transformers' hybrid cache (DynamicCache) grows every step: its decode "
                        "runs eagerly")
CALIB_SAMPLES, CALIB_SEQLEN = 4, 256


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", choices=list(PRESET_NAMES), default="130m",
                        help="random weights at this published shape (default 130m; mamba2-*: a "
                             "Mamba2 model, against mamba-ssm's own Mamba2 model; "
                             f"{', '.join(HYBRID_PRESETS)}: hybrids, against quamba's FP16 model "
                             "and transformers' own)")
    source.add_argument("--model", help="a real FP model: Hub id or directory")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, of {', '.join(PRECISIONS)} (default all)")
    parser.add_argument("--batch", default="1", metavar="B[,B...]",
                        help="batch size, or comma-separated sizes each measured in turn (default 1)")
    parser.add_argument("--state_cache", choices=STATE_CACHE_FORMATS, default="int8",
                        help="SSM state format of the quantized rows' decode cache (default int8)")
    parser.add_argument("--lm_head", choices=LM_HEAD_FORMATS, default="fp16",
                        help="lm_head format of the quantized rows (default fp16, the float head)")
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--gen_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per number (median)")
    parser.add_argument("--group_size", type=int, default=128, help="4-bit weight group size")
    parser.add_argument("--no_baseline", action="store_true",
                        help="skip mamba-ssm's own model (a hybrid: transformers' own model)")
    parser.add_argument("--reference_fp_ops", action="store_true",
                        help="without mamba-ssm, time fp16 and w4a16 on the torch references of its "
                             "conv and scan kernels (minutes per row; skipped otherwise)")
    parser.add_argument("--allow_reference_ops", action="store_true",
                        help="accept quantized ops that ran their torch reference on the GPU (the "
                             "run otherwise exits with status 1: its numbers are not the kernels')")
    parser.add_argument("--breakdown", action="store_true",
                        help="per-kernel GPU time of one decode step (eager and graphed) and one "
                             "prefill, profiled in a child process after the timings")
    parser.add_argument("--breakdown_only", action="store_true", help=argparse.SUPPRESS)  # the child's run
    parser.add_argument("--fused_decode", action="store_true",
                        help="also time the W8A8 / W4A8 models with the decode step's SSM side "
                             "fused (rows named like 'quamba w8a8 fused')")
    parser.add_argument("--op_by_op", action="store_true",
                        help="also time the quantized models with each block's decode step op "
                             "by op, without their fused decode kernels (rows named like 'quamba "
                             "w8a8 op-by-op')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        parser.error(f"unknown precision {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
    if args.lm_head == "int8" and "w4a16" in args.precisions:
        parser.error("--lm_head int8 quantizes the head's input, which w4a16 does not calibrate; "
                     "leave w4a16 out of --precisions or take --lm_head int4")
    args.batches = batch_sizes(args.batch, parser)
    for name in ("prompt_len", "gen_len", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if not torch.cuda.is_available():
        parser.error("profiling needs a CUDA GPU")
    return args


def batch_sizes(text: str, parser: argparse.ArgumentParser) -> list[int]:
    """The positive batch sizes of ``--batch`` ("1" or "1,8,32,64"), in the order given."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--batch takes comma-separated integers, got {text!r}")
    if not sizes or any(size <= 0 for size in sizes):
        parser.error(f"--batch sizes must be positive, got {text!r}")
    if len(set(sizes)) != len(sizes):
        parser.error(f"--batch repeats a size: {text!r}")
    return sizes


# --- what is timed: a model with a prefill and a graphed decode step -------------------------------

class QuambaRunner:
    """A quamba model (FP or quantized): eager prefill into the cache of its graphed decoder, or
    where graphed decode refuses the model (``graph_refusal``, its QuambaError), into a cache it
    then decodes eagerly."""

    def __init__(self, model, batch: int, device="cuda"):
        self.model = model
        try:
            self.cache, self.step = graphed_decoder(model, batch, device)
            self.graph_refusal = None
        except QuambaError as exc:
            self.cache, self.step = model.allocate_cache(batch, device=device), self.eager_step
            self.graph_refusal = str(exc)

    def prefill(self, input_ids):
        self.cache.seqlen_offset = 0
        return self.model(input_ids, cache=self.cache, num_last_tokens=1)[:, -1]

    def graphed_prefill(self, input_ids):
        """The prefill replayed from its CUDA graph into the same cache, as generate(...,
        prefill_graph=True) runs it (captured on the first call)."""
        return graphed_prefill(self.model, input_ids)

    def eager_step(self, next_ids):
        self.cache.seqlen_offset = max(self.cache.seqlen_offset, 1)
        return self.model(next_ids[:, None], cache=self.cache)[:, -1]

    def generate(self, prompt, gen_len: int, **kwargs):
        return self.model.generate(prompt, max_new_tokens=gen_len, eos_token_id=-1,
                                   cache_graph=self.graph_refusal is None, **kwargs)

    def cache_parts(self) -> dict:
        """Bytes of the decode cache: SSM state and conv state (foh's drive counted with the SSM),
        and attention's KV cache as allocated (buffers of the cache's max_seqlen tokens)."""
        states = decode_states(self.cache.states)
        mixers = [s for s in states if isinstance(s, MixerState)]
        return {"ssm": sum(s.ssm.nbytes + (0 if s.drive is None else s.drive.nbytes)
                           for s in mixers),
                "conv": sum(s.conv.nbytes for s in mixers),
                "kv": sum(s.key.nbytes + s.value.nbytes for s in states
                          if isinstance(s, AttentionState))}

    def close(self):
        self.model.__dict__.pop("_decode_graphs", None)


def decode_states(states) -> list:
    """The MixerStates and AttentionStates in a cache's per-layer states, which a hybrid's layers
    hold as None (MLP, MoE), a pair (Falcon-H1's parallel mixer) or a HybridState (Zamba2)."""
    flat = []
    for state in states:
        if isinstance(state, (MixerState, AttentionState)):
            flat.append(state)
        elif isinstance(state, tuple):
            flat += decode_states(state)
        elif state is not None:
            flat += decode_states((state.mixer, state.attention))
    return flat


class TransformersRunner:
    """transformers' own model of a hybrid family, built from the same config.json fields with its
    own random initialisation, fp16, SDPA attention (and mamba-ssm's kernels where installed):
    prefilled into a fresh DynamicCache, then decoded eagerly (the cache grows every step).
    ``config_changes`` go to its config (the CPU tests: experts_implementation)."""

    graph_refusal = TRANSFORMERS_REFUSAL

    def __init__(self, raw_config: dict, device="cuda", dtype=torch.float16, **config_changes):
        from transformers import AutoConfig, AutoModelForCausalLM
        # auto_map (Nemotron-H's remote code) left out: the installed transformers' class is timed
        fields = {k: v for k, v in raw_config.items()
                  if k not in ("model_type", "architectures", "auto_map")}
        config = AutoConfig.for_model(raw_config["model_type"], **fields, **config_changes)
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                          attn_implementation="sdpa").eval()
        self.cache, self.seqlen = None, 0
        self.step = self.eager_step

    def prefill(self, input_ids):
        out = self.model(input_ids, use_cache=True, logits_to_keep=1)
        self.cache, self.seqlen = out.past_key_values, input_ids.shape[1]
        return out.logits[:, -1]

    def eager_step(self, next_ids):
        position = torch.tensor([self.seqlen], device=next_ids.device)
        out = self.model(next_ids[:, None], past_key_values=self.cache, use_cache=True,
                         cache_position=position, logits_to_keep=1)
        self.seqlen += 1
        return out.logits[:, -1]

    def cache_parts(self) -> dict:
        """Bytes of the decode cache as it stands, read from transformers 5's cache layers."""
        parts = {"ssm": 0, "conv": 0, "kv": 0}
        for layer in self.cache.layers:
            parts["ssm"] += _tensor_bytes(getattr(layer, "recurrent_states", {}).values())
            parts["conv"] += _tensor_bytes(getattr(layer, "conv_states", {}).values())
            parts["kv"] += _tensor_bytes((getattr(layer, "keys", None), getattr(layer, "values", None)))
        return parts


def _tensor_bytes(entries) -> int:
    """Bytes of the tensors among a cache layer's entries; a state transformers has not filled
    yet is None (an attention layer's, in transformers 5.17's hybrid cache)."""
    return sum(t.nbytes for t in entries if torch.is_tensor(t))


class MambaSSMRunner:
    """mamba-ssm's MambaLMHeadModel with the FP model's weights, prefilled with InferenceParams
    and decoded from a CUDA graph, as its own generate(cg=True) does."""

    def __init__(self, fp_model: MambaLMHeadModel, batch: int, max_seqlen: int):
        from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as SSMModel
        from mamba_ssm.utils.generation import InferenceParams
        config = SSMConfig(**fp_model.config.to_mamba_ssm())
        self.model = SSMModel(config, device="cuda", dtype=torch.float16).eval()
        self.model.load_state_dict(fp_model.state_dict())
        self.cache = self.model.allocate_inference_cache(batch, max_seqlen)
        self.params = InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch,
                                      key_value_memory_dict=self.cache)
        self.step = GraphedStep(self.eager_step_ids, batch, "cuda")
        self.graph_refusal = None

    def eager_step_ids(self, input_ids):
        self.params.seqlen_offset = 1  # > 0 selects the decode path
        return self.model(input_ids, inference_params=self.params, num_last_tokens=1).logits[:, -1]

    def eager_step(self, next_ids):
        return self.eager_step_ids(next_ids[:, None])

    def prefill(self, input_ids):
        self.params.seqlen_offset = 0
        return self.model(input_ids, inference_params=self.params, num_last_tokens=1).logits[:, -1]

    def cache_parts(self) -> dict:
        """Bytes of the decode cache: mamba-ssm keeps (conv_state, ssm_state) per layer."""
        return {"ssm": sum(states[1].nbytes for states in self.cache.values()),
                "conv": sum(states[0].nbytes for states in self.cache.values())}


def weight_bytes(model) -> int:
    """Bytes of the parameters and buffers, each storage once (a tied lm_head is the embedding)."""
    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# --- measuring -----------------------------------------------------------------------------------

def greedy(runner, prompt, gen_len: int):
    logits = runner.prefill(prompt)
    for _ in range(gen_len):
        logits = runner.step(logits.argmax(-1))
    return logits


def cuda_events(fn, calls: int = 1) -> list:
    """The GPU activity (kernels, copies) of ``calls`` back-to-back calls of ``fn`` under the torch
    profiler, after one warm-up call, in order of start."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def top_kernels(totals: dict, counts: dict, top: int) -> list[dict]:
    """Rows of the ``top`` largest ``totals`` (µs per kernel name) with their ``counts``."""
    names = sorted(totals, key=totals.get, reverse=True)
    return [{"kernel": name[:90], "calls": counts[name], "us": totals[name]} for name in names[:top]]


def kernel_breakdown(fn, top: int = 12) -> list[dict]:
    """GPU time per kernel name (µs, summed over calls) of one call of ``fn``, largest first."""
    totals, counts = defaultdict(float), defaultdict(int)
    for event in cuda_events(fn):
        totals[event.name] += event.device_time
        counts[event.name] += 1
    rows = top_kernels(totals, counts, top)
    rest = sum(sorted(totals.values(), reverse=True)[top:])
    if rest:
        rows.append({"kernel": f"({len(totals) - top} other kernels)", "us": rest})
    rows.append({"kernel": "total", "calls": sum(counts.values()), "us": sum(totals.values())})
    return rows


def graph_breakdown(step, replays: int = 5, top: int = 12) -> dict:
    """The kernels of a graphed decode step as the GPU runs them (``replays`` back-to-back replays
    of ``step``), summarised by :func:`replay_timeline`."""
    kernels = cuda_events(step, replays)
    if not kernels:
        return {"note": "the profiler recorded no kernels inside the graph replays"}
    return replay_timeline([(e.name, e.time_range.start, e.time_range.end) for e in kernels],
                           replays, top)


def replay_timeline(kernels: list, replays: int, top: int = 12) -> dict:
    """``kernels`` (name, start µs, end µs), in order of start, of ``replays`` replays: per kernel
    name its calls and GPU time per replay (start to end: a programmatically dependent kernel
    starts early, and its time includes its wait); its share of the critical path (``critical``:
    the time by which it moved the latest end so far, so that the shares add up to the busy time
    and a kernel that only waited gets ~0); the GPU's idle time between kernels, by the kernel it
    waits for; and the step's span, busy time (intervals merged) and kernel sum. An idle gap is
    launch and drain time the graph did not hide."""
    times, counts, critical = defaultdict(float), defaultdict(int), defaultdict(float)
    gaps, gap_counts = defaultdict(float), defaultdict(int)
    frontier = kernels[0][1]
    for name, start, end in kernels:
        times[name] += end - start
        counts[name] += 1
        if start > frontier:
            gaps[name] += start - frontier
            gap_counts[name] += 1
        critical[name] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)

    def per_replay(totals):
        return {name: value / replays for name, value in totals.items()}
    return {"kernels": top_kernels(per_replay(times), per_replay(counts), top),
            "critical": top_kernels(per_replay(critical), per_replay(counts), top),
            "gaps_before": top_kernels(per_replay(gaps), per_replay(gap_counts), top),
            "span_us": (frontier - kernels[0][1]) / replays, "busy_us": sum(critical.values()) / replays,
            "idle_us": sum(gaps.values()) / replays, "kernel_sum_us": sum(times.values()) / replays}


def measure(name: str, runner, weights: int, prompt, args, bandwidth_gbs: float) -> dict:
    """The row of one model: its timings and memory, or with --breakdown_only its profiles."""
    first = runner.prefill(prompt).argmax(-1)
    if args.breakdown_only:
        profiles = {"name": name,
                    "decode_kernels": kernel_breakdown(lambda: runner.eager_step(first)),
                    "prefill_kernels": kernel_breakdown(lambda: runner.prefill(prompt))}
        if runner.graph_refusal is None:
            profiles["graph_decode"] = graph_breakdown(lambda: runner.step(first))
        return profiles
    graphed = runner.graph_refusal is None
    row = {
        "name": name,
        "ttft_ms": median_ms(lambda: runner.prefill(prompt), args.repeats),
        "tpot_ms": median_ms(lambda: runner.step(first), max(args.repeats, 50), warmup=5),
        "ttlt_ms": median_ms(lambda: greedy(runner, prompt, args.gen_len), args.repeats, warmup=1),
        "weights_bytes": weights,
        **cache_memory(runner.cache_parts(), args.batch),
        "tpot_floor_ms": weights / (bandwidth_gbs * 1e9) * 1e3,
        **decode_mode(runner),
    }
    if graphed:
        row["graph_launch"] = graph_launch_timing(lambda: runner.step(first), max(args.repeats, 50))
    if isinstance(runner, QuambaRunner):
        row["generate_ms"] = median_ms(lambda: runner.generate(prompt, args.gen_len), args.repeats, warmup=1)
        row["generate_each_ms"] = median_ms(lambda: runner.generate(prompt, args.gen_len, eos_check_every=1),
                                            args.repeats, warmup=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    greedy(runner, prompt, args.gen_len)
    torch.cuda.synchronize()
    row["peak_bytes"] = torch.cuda.max_memory_allocated()
    row["prefill_host_ms"], row["prefill_host_waited"] = host_ms(lambda: runner.prefill(prompt))
    if row["prefill_host_waited"]:
        row["prefill_sync"] = first_sync(lambda: runner.prefill(prompt))
    if isinstance(runner, QuambaRunner) and graphed:  # after the peak: not the prefill graphs' pool
        row["prefill_capture_ms"] = wall_ms(lambda: runner.graphed_prefill(prompt))
        row["ttft_graph_ms"] = median_ms(lambda: runner.graphed_prefill(prompt), args.repeats)
    return row


def decode_mode(runner) -> dict:
    """How a row's decode steps ran: ``graphed`` and, when not, why (``graph_refusal``)."""
    if runner.graph_refusal is None:
        return {"graphed": True}
    return {"graphed": False, "graph_refusal": runner.graph_refusal}


def wall_ms(fn) -> float:
    """Wall time in ms of one call of ``fn``, from an idle GPU until the GPU has finished it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def cache_memory(parts: dict, batch: int) -> dict:
    """A row's decode cache bytes: in all, the SSM state, the conv state and attention's KV cache
    (``kv``, where the model has one: as it stood after the last timed run), and per sequence."""
    total = parts["ssm"] + parts["conv"] + parts.get("kv", 0)
    return {"cache_bytes": total, "ssm_state_bytes": parts["ssm"],
            "conv_state_bytes": parts["conv"], "kv_cache_bytes": parts.get("kv", 0),
            "ssm_state_bytes_per_seq": parts["ssm"] // batch, "cache_bytes_per_seq": total // batch}


def breakdowns_in_child(argv: list[str]) -> dict:
    """Row name -> the --breakdown profiles, taken by this script in a child process. After a torch
    profiler session CUPTI stays attached to the process and every later launch is slower: a
    graphed Mamba-2.8B W8A8 step waited on took 2.51 ms after a profile, 2.13 before (H100;
    benchmarks/bench_graph_launch.py shows it on graphs of tiny kernels), so no timing may follow a
    profile in one process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "breakdowns.json")
        # argparse keeps the last --out: the child's replaces the caller's
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--breakdown_only", "--out", out],
                       check=True)
        with open(out) as f:
            rows = json.load(f)["rows"]
    return {row.pop("name"): row for row in rows}


# --- the models ----------------------------------------------------------------------------------

def fp_model_for(args) -> MambaLMHeadModel:
    if args.model:
        from quamba.models.loading import load_model
        model, _ = load_model(args.model, dtype=torch.float16, device="cuda", tokenizer=False)
        return model
    return randomize_(build_preset(args.config, device="cuda", dtype=torch.float16), seed=args.seed)


def transformers_config(args) -> dict | None:
    """The config.json fields transformers builds the hybrid's own model from (a preset's, or the
    --model directory's), None for a Mamba model (its baseline is mamba-ssm's)."""
    if not args.model:
        return HYBRID_PRESETS.get(args.config)
    from quamba.models.hub import read_config_json, resolve_model_dir
    raw = read_config_json(resolve_model_dir(args.model))
    return raw if raw.get("model_type") in HYBRID_TYPES else None


# transformers' model types of the hybrid families quamba loads
HYBRID_TYPES = ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2", "jamba")


def transformers_has(model_type: str) -> bool:
    """Whether the installed transformers has a model class for ``model_type``."""
    from transformers import CONFIG_MAPPING
    return model_type in CONFIG_MAPPING


def quantized_model(fp_model, precision: str, args):
    w_bits, a_bits = PRECISIONS[precision]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    calib = torch.randint(0, fp_model.config.vocab_size, (CALIB_SAMPLES, CALIB_SEQLEN),
                          generator=gen, device="cuda")
    config = QuantConfig(w_bits=w_bits, a_bits=a_bits, group_size=args.group_size, seed=args.seed,
                         lm_head=args.lm_head)
    qmodel = quantize(fp_model, config=config, calib_data=calib, progress=False)
    qmodel.__dict__["fp_model"] = None  # only the quantized blocks are timed
    qmodel.set_state_cache(args.state_cache)
    return qmodel


def variant_rows(precision: str, args) -> list[str]:
    """The rows besides its own that --op_by_op and --fused_decode add for ``precision``: its
    model without its fused kernels, op by op ("op-by-op", the quantized precisions) and with the
    int8 mixers' SSM side as qmixer_ssm_step ("fused", the int8-activation precisions)."""
    bits = PRECISIONS[precision]
    if bits is None:
        return []
    wanted = {"op-by-op": args.op_by_op, "fused": args.fused_decode and bits[1] == 8}
    return [name for name, asked in wanted.items() if asked]


def release(*objects):
    for obj in objects:
        obj.close()
    gc.collect()
    torch.cuda.empty_cache()


def run(args) -> dict:
    torch.manual_seed(args.seed)
    bandwidth = copy_bandwidth_gbs()
    fp_model = fp_model_for(args).eval()
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    prompt = torch.randint(0, fp_model.config.vocab_size, (args.batch, args.prompt_len),
                           generator=gen, device="cuda")
    rows, notes = [], {}
    hybrid = not isinstance(fp_model.config, MambaConfig)
    if not args.no_baseline:
        rows += baseline_rows(fp_model, prompt, args, bandwidth, notes)
    for precision in args.precisions:
        if precision in FP_MIXER and fp_kernels.missing() and not args.reference_fp_ops:
            notes[f"skipped {precision}"] = f"{fp_kernels.missing()}; see --reference_fp_ops"
            continue
        print(f"profiling {precision} ...", file=sys.stderr, flush=True)
        if precision == "fp16":
            rows.append(measure_quamba(QUAMBA_FP16, fp_model, prompt, args, bandwidth))
            continue
        try:
            with torch.no_grad():
                qmodel = quantized_model(fp_model, precision, args)
        except QuambaError as exc:  # a recipe this family refuses: the notes say why
            notes[f"skipped {precision}"] = str(exc)
            continue
        fp_model.to("cpu")
        rows.append(measure_quamba(f"quamba {precision}", qmodel, prompt, args, bandwidth))
        for variant in variant_rows(precision, args):
            qmodel.set_fused_layer(False).set_fused_ssm_step(False)
            qmodel.set_fused_decode(variant == "fused")
            rows.append(measure_quamba(f"quamba {precision} {variant}", qmodel, prompt, args,
                                       bandwidth))
        del qmodel
        release()
        fp_model.to("cuda")
    anchors = {} if args.breakdown_only else _add_ratios(rows, args, hybrid)
    config = fp_model.config.to_dict()
    return {"meta": run_metadata(), "copy_bandwidth_gbs": bandwidth, "model": args.model or args.config,
            "config": config, "batch": args.batch, "state_cache": args.state_cache, "lm_head": args.lm_head,
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "repeats": args.repeats, "fp_kernels": fp_kernels.missing() is None,
            "baselines": baseline_descriptions(fp_model, hybrid), "ratio_baselines": anchors,
            "rows": rows, "notes": notes}


def measure_quamba(name: str, model, prompt, args, bandwidth) -> dict:
    release()
    with torch.inference_mode(), backend.recording() as ran:
        runner = QuambaRunner(model, args.batch)
        row = measure(name, runner, weight_bytes(model), prompt, args, bandwidth)
    row["backends"] = backend.summary(ran)
    row["reference_ops"] = backend.on_reference(ran)
    row["reference_fp_ops"] = backend.on_reference(ran, backend.fp_ops())
    release(runner)
    return row


def baseline_rows(fp_model, prompt, args, bandwidth, notes) -> list[dict]:
    """The external FP16 baseline's row: mamba-ssm's model for a Mamba model, transformers' own
    model for a hybrid (none, with a note, where it cannot be built; where transformers' model
    fails, its error is noted as ``transformers_baseline_error`` and quamba's rows still run)."""
    if isinstance(fp_model.config, MambaConfig):
        if fp_kernels.missing():
            notes["baseline"] = fp_kernels.missing()
            return []
        return [_baseline_row(fp_model, prompt, args, bandwidth, notes)]
    raw = transformers_config(args)
    if raw is None or not transformers_has(raw["model_type"]):
        import transformers
        notes["transformers_baseline"] = (f"transformers {transformers.__version__} has no model "
                                          "class for this family")
        return []
    fp_model.to("cpu")
    try:
        return [_transformers_row(raw, prompt, args, bandwidth)]
    except Exception as exc:  # another library's model, whatever its version raises
        notes["transformers_baseline_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return []
    finally:
        release()
        fp_model.to("cuda")


def _transformers_row(raw: dict, prompt, args, bandwidth) -> dict:
    print("profiling transformers' model ...", file=sys.stderr, flush=True)
    with torch.inference_mode():
        runner = TransformersRunner(raw)
        row = measure(TRANSFORMERS_BASELINE, runner, weight_bytes(runner.model), prompt, args,
                      bandwidth)
    row["mamba_ssm_kernels"] = fp_kernels.missing() is None
    del runner
    return row


def baseline_descriptions(fp_model, hybrid: bool) -> dict:
    """What each FP16 baseline row is, for the record."""
    quamba_fp16 = ("quamba's FP model: its Mamba layers on mamba-ssm's and causal-conv1d's kernels "
                   "(quamba.ops.fp_kernels; Mamba2's SSD in Triton)"
                   + (", attention in SDPA" if hybrid else ""))
    if hybrid:
        return {QUAMBA_FP16: quamba_fp16, TRANSFORMERS_BASELINE: (
            "transformers' own model of the family from the same config.json, its own random "
            "weights, SDPA attention, mamba-ssm's kernels when installed (the row's "
            "mamba_ssm_kernels), eager decode")}
    ssm = "mamba-ssm's MambaLMHeadModel with the same weights, decode from a CUDA graph"
    if fp_model.config.mixer_rms_eps is not None:
        ssm += "; without Falcon-Mamba's norms of dt, B and C, which mamba-ssm's Mamba lacks"
    return {BASELINE: ssm, QUAMBA_FP16: quamba_fp16}


def _baseline_row(fp_model, prompt, args, bandwidth, notes) -> dict:
    """mamba-ssm's model, measured alone on the GPU; also how far quamba's FP16 logits are from it."""
    print("profiling mamba-ssm ...", file=sys.stderr, flush=True)
    with torch.inference_mode():
        runner = MambaSSMRunner(fp_model, args.batch, args.prompt_len + args.gen_len + 1)
        ours = fp_model(prompt, num_last_tokens=1)[:, -1].float()
        theirs = runner.prefill(prompt).float()
        notes["fp16_logits_rel_error_vs_mamba_ssm"] = float((ours - theirs).norm() / theirs.norm())
        notes["fp16_top1_agreement_vs_mamba_ssm"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    if fp_model.config.mixer_rms_eps is not None:
        notes["baseline_without_mixer_norms"] = (
            "mamba-ssm's Mamba has no norms of dt, B and C (Falcon-Mamba): the baseline runs the "
            "same weights without them, so its logits differ")
    fp_model.to("cpu")
    release()
    with torch.inference_mode():
        row = measure(BASELINE, runner, weight_bytes(runner.model), prompt, args, bandwidth)
    del runner
    release()
    fp_model.to("cuda")
    return row


RATIO_METRICS = ("ttft_ms", "tpot_ms", "ttlt_ms")


def ratio_anchors(rows: list[dict], hybrid: bool) -> dict:
    """Each timed number's baseline row: a Mamba model's mamba-ssm row (quamba's FP16 row without
    it); for a hybrid, the faster of quamba's FP16 row and transformers' for that number. {} when
    there is none."""
    names = (QUAMBA_FP16, TRANSFORMERS_BASELINE) if hybrid else (BASELINE,)
    candidates = [r for r in rows if r["name"] in names]
    if not candidates:
        candidates = [r for r in rows if r["name"] == QUAMBA_FP16]
    if not candidates:
        return {}
    return {metric: min(candidates, key=lambda r: r[metric]) for metric in RATIO_METRICS}


def _add_ratios(rows: list[dict], args, hybrid: bool = False) -> dict:
    """Adds each row's throughputs, sizes and speed-ups; returns which row each ratio is to."""
    anchors = ratio_anchors(rows, hybrid)
    for row in rows:
        row["batch"] = args.batch
        row["decode_tokens_per_s"] = args.batch / row["tpot_ms"] * 1e3
        row["prefill_tokens_per_s"] = args.batch * args.prompt_len / row["ttft_ms"] * 1e3
        row["weights_gb"] = row["weights_bytes"] / 1e9
        row["cache_mb"] = row["cache_bytes"] / 1e6
        row["ssm_state_mb_per_seq"] = row["ssm_state_bytes_per_seq"] / 1e6
        row["peak_gb"] = row["peak_bytes"] / 1e9
        if anchors:
            for metric in RATIO_METRICS:
                row[metric.replace("_ms", "_speedup")] = anchors[metric][metric] / row[metric]
            if "ttft_graph_ms" in row:
                row["ttft_graph_speedup"] = anchors["ttft_ms"]["ttft_ms"] / row["ttft_graph_ms"]
            row["weights_ratio"] = row["weights_bytes"] / anchors["tpot_ms"]["weights_bytes"]
    return {metric.replace("_ms", "_speedup"): anchor["name"] for metric, anchor in anchors.items()}


COLUMNS = ["name", "batch", "ttft_ms", "ttft_graph_ms", "prefill_capture_ms", "prefill_host_ms", "tpot_ms",
           "decode_tokens_per_s", "prefill_tokens_per_s",
           "tpot_floor_ms", "ttlt_ms", "generate_ms", "generate_each_ms",
           "weights_gb", "cache_mb", "ssm_state_mb_per_seq", "peak_gb", "ttft_speedup", "ttft_graph_speedup",
           "tpot_speedup", "ttlt_speedup", "weights_ratio"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if len(args.batches) > 1:  # one run per size, each in its own process state as a single run
        results, status = [], 0
        for batch in args.batches:
            args.batch = batch
            result, code = run_one(args, _with_batch(argv, batch))
            results.append(result)
            status = max(status, code)
        write_json(args.out, {"runs": results})
        return status
    args.batch = args.batches[0]
    result, code = run_one(args, argv)
    write_json(args.out, result)
    return code


def _with_batch(argv: list[str], batch: int) -> list[str]:
    """``argv`` with its --batch replaced by one size (for the --breakdown child)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--batch":
            skip = True
        elif not arg.startswith("--batch="):
            out.append(arg)
    return out + ["--batch", str(batch)]


def run_one(args, argv: list[str]) -> tuple[dict, int]:
    """One batch size: (its result, the exit status its backends give); prints its tables."""
    result = run(args)
    if args.breakdown_only:
        return result, 0
    if args.breakdown:
        profiles = breakdowns_in_child(argv)
        for row in result["rows"]:
            row.update(profiles.get(row["name"], {}))
    meta = result["meta"]
    title = (f"{result['model']} batch {args.batch}, prompt {args.prompt_len}, {args.gen_len} new tokens "
             f"on {meta['device']} ({meta['date']}, commit {meta['commit']}); copy bandwidth "
             f"{result['copy_bandwidth_gbs']:.0f} GB/s")
    print(format_table(result["rows"], COLUMNS, title))
    for key, value in result["notes"].items():
        print(f"{key}: {value}")
    for ratio, name in result["ratio_baselines"].items():
        print(f"{ratio} is to {name!r}: {result['baselines'][name]}")
    for row in result["rows"]:
        for part in ("decode_kernels", "prefill_kernels"):
            if part in row:
                print(format_table(row[part], ["kernel", "calls", "us"], f"{row['name']}: {part}"))
        graph = row.get("graph_decode", {})
        if "kernels" in graph:
            summary = ", ".join(f"{key} {graph[key]:.1f}"
                                for key in ("span_us", "busy_us", "idle_us", "kernel_sum_us"))
            columns = ["kernel", "calls", "us"]
            print(format_table(graph["kernels"], columns, f"{row['name']}: graph replay ({summary})"))
            print(format_table(graph["critical"], columns, f"{row['name']}: share of the critical path"))
            print(format_table(graph["gaps_before"], columns, f"{row['name']}: idle before"))
        if not row.get("graphed", True):
            print(f"{row['name']}: decoded eagerly, not from CUDA graphs: {row['graph_refusal']}")
        if "graph_launch" in row:
            print(f"{row['name']}: graph launch, µs: " +
                  ", ".join(f"{key} {value:.1f}" for key, value in row["graph_launch"].items()))
        if row.get("prefill_host_waited"):
            print(f"{row['name']}: prefill_host_ms is an upper bound: the GPU's sleep ended before the "
                  "host had issued the prefill (it waited for the GPU, or took longer than the sleep); "
                  f"torch's first synchronizing call in it: {row.get('prefill_sync') or 'none'}")
        if "backends" in row:
            print(f"{row['name']}: backends: " +
                  ", ".join(f"{op} {name}" for op, name in row["backends"].items()))
        if "ssm_state_bytes" in row:
            print(f"{row['name']}: batch {row['batch']} state cache: SSM state "
                  f"{row['ssm_state_bytes'] / 1e6:.2f} MB ({row['ssm_state_bytes_per_seq'] / 1e6:.3f} MB "
                  f"per sequence), conv state {row['conv_state_bytes'] / 1e6:.2f} MB")
    baseline_failed = "transformers_baseline_error" in result["notes"]
    return result, max(int(baseline_failed),
                       check_backends(result["rows"], args.allow_reference_ops, args.reference_fp_ops))


if __name__ == "__main__":
    sys.exit(main())
