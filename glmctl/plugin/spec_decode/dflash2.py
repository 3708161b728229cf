"""DFlash2 drafting (vLLM's `DFlash2DraftModel`, `method: dflash`) on GLM-5.3-Flash.

What vLLM 0.30 ships, read from its source:

- The draft model, `model_executor/models/qwen3_dflash2.py`: `DFlash2Qwen3ForCausalLM` extends the
  DFlash Qwen3 drafter (`qwen3_dflash.py`) with grouped block convolutions around attention and
  MLP and a low-rank `CandidateSelector`: the LM head's top-k candidates per draft position are
  re-scored pairwise (predecessor x successor codebooks) and the drafts are a walk along the
  block. Attention is plain (non-causal) attention over context K/V that the drafter projects
  from the target's hidden states at `dflash_config.target_layer_ids` (`precompute_and_store_
  context_kv`, one fused GEMM for all draft layers) plus K/V of its own 1 + N query tokens.
- Two runners. CUDA uses the V2 model runner (`v1/worker/gpu/`), whose
  `spec_decode/dflash2/speculator.py` (`DFlash2Speculator`, chosen when the draft's
  architectures name `DFlash2DraftModel`) runs the selector walk in Triton, supports sampled
  drafts, several draft KV-cache groups, and FULL CUDA graphs of the query forward (captured
  for every batch of `num_reqs x (1 + N)` tokens; the context precompute stays eager).
  vLLM CPU's `CPUModelRunner` extends the V1 `gpu_model_runner.py` (V2 needs Triton), whose
  drafting goes through `v1/spec_decode/dflash.py` (`DFlashProposer`): greedy argmax of the LM
  head per position, one draft KV group, no selector at all. vLLM therefore refuses DFlash2
  drafts on V1 (`VllmConfig._get_v1_model_runner_unsupported_features`: "dflash2 drafts").
- What both assume about the target: it implements `SupportsEagle3` (`set_aux_hidden_state_
  layers`, a forward that returns `(hidden, [aux...])`, aux layer `i` being the input of layer
  `i`), and its KV cache is laid out by vLLM's generic grouping, with the drafter's attention
  layers in groups of their own or merged by page size.

What GLM-5.3-Flash needs on top, installed here (none of it is a fork):

- aux hidden states: `Glm5NextForCausalLM` has none. Forward hooks on the chosen decoder
  layers record each layer's output; mHC layers defer their residual-stream update to the next
  layer, so the hook completes it (`hc_post`) and averages the streams (`hc_contract`), the
  hidden state the next layer's streams hold.
- the KV cache: `glmctl.plugin.spec_decode.dflash2_kv` (stock vLLM cannot lay GLM-5.3-Flash's pool out once
  a non-MLA layer joins it).
- on V1 (vLLM CPU): the selector walk in torch in place of the proposer's argmax, so DFlash2
  drafts as DFlash2 and the refusal can be lifted for GLM-5.3-Flash; and the DFlash input
  kernel in torch (vLLM CPU rebinds the Triton kernel by a name the proposer no longer calls).

Limits that remain (the serve preflight states them): on V1 the walk is always greedy, as it is
by default on V2 (`draft_sample_method: probabilistic` samples it on V2 only; V1 verifies greedy
drafts by rejection sampling, so sampled requests stay exact); the drafter's KV block size must
equal the target's (it does whenever vLLM builds both from one cache config).
"""

from __future__ import annotations

import torch

from glmctl.plugin.policy import Target

V1_REFUSAL = "dflash2 drafts"


def install(target: Target) -> list[str]:
    from glmctl.plugin.spec_decode import dflash2_kv

    installed = [dflash2_kv.install(), _install_aux_hidden_states(), _install_v1_selector_walk()]
    if target is Target.TORCH:
        from glmctl.plugin.platforms.cpu.dflash2_cpu import install as install_cpu

        installed.append(install_cpu())
    return installed


# -- aux hidden states --------------------------------------------------------------------------


def _install_aux_hidden_states() -> str:
    from vllm.models.glm5next.nvidia.model import (
        Glm5NextForCausalLM,
        Glm5NextForConditionalGeneration,
        Glm5NextModel,
    )

    from glmctl.plugin.patching import wrap_once

    for cls in (Glm5NextForCausalLM, Glm5NextForConditionalGeneration):
        # SupportsEagle3 is a runtime-checkable protocol: these members are what vLLM checks.
        cls.supports_eagle3 = True
        cls.has_own_lm_head = False
        cls.has_own_embed_tokens = False
        cls.set_aux_hidden_state_layers = set_aux_hidden_state_layers
        cls.get_eagle3_default_aux_hidden_state_layers = default_aux_hidden_state_layers

    def make(stock_forward):
        def forward(self, *args, **kwargs):
            if not getattr(self, "_glmctl_aux_layers", ()):
                return stock_forward(self, *args, **kwargs)
            self._glmctl_aux = {}
            hidden = stock_forward(self, *args, **kwargs)
            aux, self._glmctl_aux = self._glmctl_aux, None
            return hidden, [aux[i] for i in self._glmctl_aux_layers]

        return forward

    wrap_once(Glm5NextModel, "forward", make, "dflash2_aux")
    return "DFlash2 aux hidden states"


def _inner_model(model):
    from vllm.models.glm5next.nvidia.model import Glm5NextModel

    return next(m for m in model.modules() if isinstance(m, Glm5NextModel))


def default_aux_hidden_state_layers(self) -> tuple[int, ...]:
    n = len(_inner_model(self).layers)
    return (2, n // 2, n - 3) if n > 4 else tuple(range(1, n))


def set_aux_hidden_state_layers(self, layers) -> None:
    """Aux layer `i` (vLLM's convention) is the hidden state entering layer `i`: the output of
    layer `i - 1`; DFlash's `target_layer_ids` are `i - 1`."""
    inner = _inner_model(self)
    layers = tuple(sorted(set(int(i) for i in layers)))
    if not all(1 <= i <= len(inner.layers) for i in layers):
        raise ValueError(f"aux hidden-state layers {layers} outside 1..{len(inner.layers)} "
                         f"(the drafter's target_layer_ids must name GLM-5.3-Flash layers)")
    for handle in getattr(inner, "_glmctl_aux_hooks", ()):
        handle.remove()
    inner._glmctl_aux_layers = layers
    inner._glmctl_aux_hooks = [inner.layers[i - 1].register_forward_hook(_record(inner, i)) for i in layers]


def _record(inner, aux_index: int):
    import weakref

    owner = weakref.ref(inner)  # the layers live inside the model; no cycle through the hook

    def hook(layer, args, output):
        store = getattr(owner(), "_glmctl_aux", None)
        if store is not None:
            store[aux_index] = layer_hidden_state(layer, output)

    return hook


def layer_hidden_state(layer, output) -> torch.Tensor:
    """A decoder layer's output as one [tokens, hidden] tensor.

    mHC layers return (layer output, residual streams, post mix, combination) and leave the
    stream update to the next layer; completing it here (`hc_post`) gives the streams after this
    layer, averaged as the model's last layer does (`hc_contract`). The last layer, and layers
    without mHC, return the hidden state itself.
    """
    x, residual, post, comb = output
    if post is None:
        return x
    from vllm.model_executor.layers.mhc import hc_contract

    return hc_contract(layer.hc_post(x, residual, post, comb), layer.n)


# -- V1 proposer (vLLM CPU): the candidate-selector walk -----------------------------------------


def selector_walk(candidate_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Greedy DFlash2 drafts: at each step the best successor of the previous step's choice.

    `candidate_ids` [requests, steps, k], `scores` [requests, steps, k (previous), k (next)]
    (`CandidateSelector`'s output). Step 0's rows all score from the anchor token, so its
    previous choice is taken as 0, as vLLM's `_selector_walk_kernel` does; ties go to the lower
    index, as an argmax does.
    """
    reqs, steps, k = candidate_ids.shape
    rows = torch.arange(reqs, device=candidate_ids.device)
    previous = torch.zeros(reqs, dtype=torch.long, device=candidate_ids.device)
    drafts = torch.empty(reqs, steps, dtype=candidate_ids.dtype, device=candidate_ids.device)
    for step in range(steps):
        choice = scores[rows, step, previous].float().argmax(dim=-1)
        drafts[:, step] = candidate_ids[rows, step, choice]
        previous = choice
    return drafts


def _install_v1_selector_walk() -> str:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from glmctl.plugin.patching import wrap_once
    from glmctl.plugin.policy import model_is_glm5_next

    def make_sample(stock):
        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            if not hasattr(self.model, "compute_candidates"):
                return stock(self, hidden_states, sampling_metadata)
            return dflash2_drafts(self, hidden_states), None

        return _sample_draft_tokens

    def make_features(stock):
        def _get_v1_model_runner_unsupported_features(self):
            unsupported = stock(self)
            if V1_REFUSAL in unsupported and model_is_glm5_next(self):
                unsupported.remove(V1_REFUSAL)  # the walk below stands in for the V2 speculator's
            return unsupported

        return _get_v1_model_runner_unsupported_features

    wrap_once(DFlashProposer, "_sample_draft_tokens", make_sample, "dflash2")
    wrap_once(VllmConfig, "_get_v1_model_runner_unsupported_features", make_features, "dflash2")
    return "DFlash2 selector walk (V1 runner)"


def dflash2_drafts(proposer, hidden_states: torch.Tensor) -> torch.Tensor:
    """The V1 proposer's drafts for a DFlash2 model: [requests * steps] token ids."""
    model = proposer.model
    steps = proposer.num_speculative_tokens
    reqs = hidden_states.shape[0] // steps
    candidate_ids, unary = model.compute_candidates(hidden_states)
    k = candidate_ids.shape[-1]
    candidate_ids = candidate_ids.view(reqs, steps, k)
    unary = unary.view(reqs, steps, k)
    # each request's query block is [bonus token, mask x steps]: the bonus token anchors the walk
    anchors = proposer.input_ids[torch.arange(reqs, device=hidden_states.device) * (1 + steps)]
    scores = model.model.candidate_selector(candidate_ids, unary, hidden_states.view(reqs, steps, -1),
                                            anchors.to(candidate_ids.dtype))
    return selector_walk(candidate_ids, scores).view(-1)
