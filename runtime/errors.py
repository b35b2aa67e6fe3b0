"""The library's exception types. Messages read `<what is wrong>: <values>. <how to fix it>.`"""

from __future__ import annotations

import contextlib


class DCPError(Exception):
    """Base class of every error dcp_compile raises on purpose."""


class DCPConfigError(DCPError, ValueError):
    """A DCP configuration breaks one or more rules; ``violations`` lists every one of them."""

    def __init__(self, violations):
        if isinstance(violations, str):
            violations = [violations]
        self.violations = list(violations)
        if len(self.violations) == 1:
            msg = self.violations[0]
        else:
            msg = f"{len(self.violations)} DCP configuration rules are broken:\n" + "\n".join(
                f"  - {v}" for v in self.violations)
        super().__init__(msg)


class DCPProofError(DCPError):
    """A layout theorem failed to prove; the certificate carries the counterexample."""

    def __init__(self, certificate):
        self.certificate = certificate
        failed = [t for t in certificate.theorems if t.status != "proven"]
        lines = [f"  - {t.name}: {t.statement} (counterexample: {t.counterexample})"
                 for t in failed]
        super().__init__("layout proof failed for " + certificate.describe() + ":\n"
                         + "\n".join(lines))


class DCPInputError(DCPError, ValueError):
    """Runtime inputs (positions, block tables, caches) that the layout cannot serve.

    A step-contract violation (dcp_compile.runtime.serving.step_contract) also carries ``rule`` (the rule's
    name), ``field`` (the input) and ``index`` (the offending element, e.g. ``(row, col)``).
    """

    def __init__(self, message="", *, rule=None, field=None, index=None):
        super().__init__(message)
        self.rule, self.field, self.index = rule, field, index


class DCPTransformError(DCPError):
    """The model's graph cannot be rewritten (unknown attention, no attention, dynamic shapes)."""


class DCPTokenMixingError(DCPTransformError):
    """An op outside attention mixes tokens along the sequence (a token shift, a roll, a
    pad + slice, a convolution or a cumsum over it): a paged step computes each token once,
    beside the cached keys of the tokens before it, which it cannot read back."""


class DCPLengthDependentError(DCPTransformError):
    """A position function depends on the sequence length or on ``max(positions)``
    (LongRoPE's switch to long factors, dynamic NTK) and is not constant over the program's
    ``max_model_len``: keys already cached cannot follow a change of that function."""


class DCPHybridError(DCPTransformError):
    """A hybrid (recurrent + attention) model asks for what its recurrent state cannot give
    yet (speculative steps, prefix caching, a chunk step, the vLLM plugin, prefill of a
    gated-attention hybrid), or its recurrent mixer's code is
    not the code the module swap was written against (docs/hybrid.md)."""


class DCPOutputContractError(DCPTransformError):
    """The model's forward returns less than every token's logits (nanoGPT's inference
    forward: the last position's only). A program returns the logits of every token of its
    step; picking the last one is the caller's, not a silent change of what the model
    returns."""


class DCPSparseAttentionError(DCPTransformError):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the indexer's top-k over a sharded
    context. The attention keeps only the keys a data-dependent ``topk`` picks over ALL prior
    tokens; a DCP rank holds only its shard of the keys (and of the indexer's K), so its own
    top-k picks a different set. The exact decode selection exists as runtime ops
    (runtime/kernels/sparse_attention.py); the rewrite that emits them from a captured model
    is not built yet, so transform refuses (docs/moe-mla.md)."""


class DCPCompressedAttentionError(DCPTransformError):
    """Compressed attention (DeepSeek-V4's HCA and CSA): KV entries each pooled from a group of
    tokens (a softmax-gated sum over a window of the sequence), attended beside the
    sliding-window keys in one softmax. An entry mixes tokens across positions of the cache:
    under DCP a window's tokens sit on different ranks, and the entry is written only when its
    window closes; no paged cache of per-token K/V holds it (docs/moe-mla.md: DeepSeek-V4)."""


class DCPKVLayoutError(DCPTransformError):
    """Per-layer KV layouts (head_dim / KV heads by layer type) or KV shared across layers
    (Gemma 4) in a form that cannot be served exactly: a layer sharing only one of another
    layer's K and V, or a path that keeps one cache layout per model (``hf.prepare``'s
    wrapper). docs/models.md: Per-layer KV layouts."""


class DCPCompilerBug(DCPError):
    """A non-DCPError exception escaped a pass or a frontend: a bug in dcp_compile, not a
    refusal. ``stage`` names the pass or frontend step, ``original`` is the exception."""

    def __init__(self, stage: str, original: BaseException):
        self.stage, self.original = stage, original
        first = str(original).splitlines()[0].rstrip(".") if str(original) else ""
        super().__init__(
            f"internal error in {stage}: {type(original).__name__}: {first}. This is a bug "
            f"in dcp_compile, not a limit of DCP; please report it with the model that "
            f"triggers it (the original exception is chained below).")


@contextlib.contextmanager
def compiler_bugs_named(stage: str):
    """Inside: any exception that is not a DCPError becomes a :class:`DCPCompilerBug`
    naming ``stage`` (a refusal is the library's own word; anything else is a bug)."""
    try:
        yield
    except DCPError:
        raise
    except Exception as e:
        raise DCPCompilerBug(stage, e) from e


class DCPCheckError(DCPTransformError):
    """transform(check=...) ran the program against the model and they differ (or the
    program did not run); ``report`` is the dcp_compile.check.CheckReport."""

    def __init__(self, message, report=None):
        self.report = report
        super().__init__(message)


class DCPTransferError(DCPError):
    """A disaggregated KV transfer cannot be planned or did not complete."""


class DCPLoweringError(DCPError):
    """A program (or function) cannot be lowered to StableHLO; the message names the op, the
    node and the pass that introduced it."""


class DCPXLAError(DCPError):
    """jaxlib is missing, the host has too few XLA devices, or XLA rejected a module (the
    message names the step and the module's path)."""


class DCPNeuronError(DCPError, RuntimeError):
    """The Neuron route cannot run here (packages missing) or cannot bind a program."""


class DCPWorldError(DCPError, RuntimeError):
    """A distributed world could not run a program: a rank raised or timed out, a launch
    failed, or the world does not match the topology.

    ``failures`` maps each failing rank to its traceback or captured output; ``timed_out``
    lists the ranks that did not finish in time; ``leaked``, the thread ranks that could not
    be stopped and still run (``dcp_compile.runtime.distributed.world.leaked_ranks()``).
    """

    def __init__(self, message, failures=None, timed_out=(), leaked=()):
        self.failures = dict(failures or {})
        self.timed_out = list(timed_out)
        self.leaked = list(leaked)
        super().__init__(message)
