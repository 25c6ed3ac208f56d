"""The Show, Attend and Tell LSTM decoder (Xu et al. 2015, sections 3.1.2 and 4).

Shapes: B images, N captions, L locations, D feature channels, H LSTM units, E embedding size,
V vocabulary size, T teacher-forced steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel

from captioner.config import PER_WORD_GRAPHS, Attention, Compile, Gate, HardEstimator, HardInference, NetConfig
from captioner.errors import ConfigError
from captioner.model.attention import AdditiveAttention, build_attention
from captioner.model.graphs import GraphCache

State = tuple[Tensor, Tensor]
# logits, the new state, alpha, the sampled location's log-probability and alpha's entropy (hard, training)
StepOutput = tuple[Tensor, State, Tensor, Tensor | None, Tensor | None]


@dataclass
class DecoderOutput:
    """Teacher-forced decoder outputs for N captions of T steps (targets are ``captions[:, 1:]``).

    For hard attention in training mode, ``entropy`` (of alpha_t) and ``sampled`` (which sequences
    read sampled locations rather than the expected context) are set, and with the REINFORCE
    estimator also ``location_log_probs`` (log alpha of the sampled location, 0 where the expected
    context was used).
    """

    logits: Tensor  # (N, T, V)
    alphas: Tensor  # (N, T, L)
    location_log_probs: Tensor | None = None  # (N, T)
    entropy: Tensor | None = None  # (N, T)
    sampled: Tensor | None = None  # (N,) bool


class ShowAttendTellDecoder(nn.Module):
    """LSTM decoder with soft or hard attention, a gating scalar and the deep output layer.

    ``config`` gives the attention mode (``attention``), the scorer (``scorer``) and the decoder's settings
    (``decoder``: sizes, gate, dropout, hard attention's options); its encoder and self-attention settings
    are not read. ``vocab_size`` words, ``feature_dim`` channels per grid location.
    """

    # The parameters with a row per word id (V, ...): the embedding E and the output layer L_o (weight and bias).
    # Every other parameter and buffer is the same size whatever the vocabulary (``model.vocab_transfer``).
    WORD_ROWS = ("embedding.weight", "classifier.weight", "classifier.bias")

    def __init__(self, vocab_size: int, feature_dim: int, config: NetConfig) -> None:
        super().__init__()
        settings = config.decoder
        embed_dim, hidden_dim = settings.embed_dim, settings.hidden_dim
        self.mode = config.attention
        self.hard_expectation_final = settings.hard_expectation_prob
        self.hard_expectation_warmup = settings.hard_expectation_warmup
        self.settings = settings  # read at inference for hard_inference (``hard_read``): one owner, the config
        self.hard_estimator = settings.hard_estimator
        self.gumbel_tau_start, self.gumbel_tau_min = settings.gumbel_tau, settings.gumbel_tau_min
        # annealed by ``anneal`` during training; a tensor, so that a compiled step reads it rather than
        # compiling again for each value
        self.register_buffer("gumbel_tau", torch.tensor(settings.gumbel_tau), persistent=False)
        # the share of images reading the expected context (hard attention, training), annealed: a buffer as well
        self.register_buffer("expectation_share", torch.tensor(settings.hard_expectation_prob), persistent=False)
        self.embedding = nn.Embedding(vocab_size, embed_dim)  # E
        self.attention = build_attention(
            config.scorer, feature_dim, hidden_dim, settings.attention_dim, settings.attention_heads
        )
        self.init_h = nn.Linear(feature_dim, hidden_dim)  # f_init,h
        self.init_c = nn.Linear(feature_dim, hidden_dim)  # f_init,c
        gates = {Gate.scalar: 1, Gate.vector: feature_dim}
        self.f_beta = nn.Linear(hidden_dim, gates[settings.gate]) if settings.gate in gates else None
        self.lstm = nn.LSTMCell(embed_dim + feature_dim, hidden_dim)
        self.dropout = nn.Dropout(settings.dropout)
        if settings.deep_output:
            self.deep_h = nn.Linear(hidden_dim, embed_dim)  # L_h
            self.deep_z = nn.Linear(feature_dim, embed_dim)  # L_z
            self.classifier = nn.Linear(embed_dim, vocab_size)  # L_o
        else:
            self.deep_h = self.deep_z = None
            self.classifier = nn.Linear(hidden_dim, vocab_size)
        self.compiled_step: Callable[..., StepOutput] | None = None  # ``compile_step``'s; None: eager
        self.graphed = False  # whether the compiled step replays CUDA graphs (reduce-overhead, max-autotune)
        # decoding calls captured as CUDA graphs (``decoding.decode``, on CUDA); None: every call eager
        self.decoding_graphs: GraphCache | None = GraphCache()

    def compile_step(self, mode: Compile) -> None:
        """Run every step (teacher-forced or decoding, one word each) through ``torch.compile(mode=mode)``
        of the one-word step, whole (``fullgraph``), with its inputs' batch dimension dynamic: one
        compilation per train/eval mode and state shape serves every caption length, batch size and word.
        ``Compile.off``: eager again.

        The compiled function is the class's, given this decoder as a partial's argument rather than bound to
        it: a ``deepcopy`` of the decoder (``AveragedModel``'s, say) then steps with the copy's own weights."""
        self.compiled_step = None
        self.graphed = mode in PER_WORD_GRAPHS
        if mode != Compile.off:
            step = torch.compile(ShowAttendTellDecoder._eager_step, mode=mode.value, fullgraph=True)
            self.compiled_step = functools.partial(step, self)

    def fuse_attention(self, on: bool) -> None:
        """Run the additive scorer's read (eq. 4-5 and the context) as one inductor-compiled function (``on``;
        ``model.fused_attention``) or eagerly; ConfigError for another scorer, which has no fused read."""
        if not isinstance(self.attention, AdditiveAttention):
            if on:
                raise ConfigError(
                    f"model.fused_attention=true needs scorer=additive, not {type(self.attention).__name__}"
                )
            return
        self.attention.fused = on

    def use_decoding_graphs(self, on: bool) -> None:
        """Replay each decoding call on CUDA as one CUDA graph (``on``, the default) or run it eagerly."""
        self.decoding_graphs = GraphCache() if on else None

    @property
    def hard_expectation_prob(self) -> float:
        """The share of images that read the expected context in hard attention's training now (``anneal``'s)."""
        return float(self.expectation_share)

    @hard_expectation_prob.setter
    def hard_expectation_prob(self, share: float) -> None:
        self.expectation_share.fill_(share)

    @property
    def hard_read(self) -> HardInference | None:
        """What this decoder reads at inference: None for soft attention (the expected context), else hard
        attention's ``hard_inference`` (the most likely location, or the expected context). The one answer to
        "is this a hard attention model, and which read"; ``hard_inference`` is its config's
        (``model.decoder.hard_inference``, a bundle's, or what ``--hard-inference`` set there)."""
        return self.settings.hard_inference if self.mode == Attention.hard else None

    def anneal(self, progress: float) -> None:
        """Set what changes over training for ``progress`` in [0, 1]: the Gumbel-softmax temperature falls
        geometrically from ``gumbel_tau`` at 0 to ``gumbel_tau_min`` at 1; the share of images reading the
        expected context falls linearly from 1 at 0 to ``hard_expectation_prob`` at ``hard_expectation_warmup``."""
        progress = min(max(progress, 0.0), 1.0)
        self.gumbel_tau.fill_(self.gumbel_tau_start * (self.gumbel_tau_min / self.gumbel_tau_start) ** progress)
        warm = 1.0 if self.hard_expectation_warmup == 0 else min(progress / self.hard_expectation_warmup, 1.0)
        self.hard_expectation_prob = 1.0 - (1.0 - self.hard_expectation_final) * warm

    def init_state(self, features: Tensor) -> State:
        """h_0 = tanh(f_init,h(mean_i a_i)), c_0 = tanh(f_init,c(mean_i a_i)), each (B, H)."""
        mean = features.mean(dim=1)  # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def step(self, tokens: Tensor, state: State, features: Tensor, keys: Tensor) -> StepOutput:
        """One decoding step from the previous tokens (B,) and state (B, H) x 2 of the features (B, L, D)
        and keys (B, L, A).

        Returns logits (B, V), the new state, alpha (B, L) and, for hard attention in training mode
        (a location sampled in every row), the location log-probability (B,) and entropy (B,).
        With K sequences per image (tokens (B, K), state (B, K, H) x 2, e.g. the beams of a beam
        search), each image's one copy of features and keys serves all K and every output gains the
        K axis: logits (B, K, V), alpha (B, K, L), ...
        """
        return self._step(self.embedding(tokens), state, features, keys, expect=None)

    def forward(self, features: Tensor, captions: Tensor, image_index: Tensor | int | None = None) -> DecoderOutput:
        """Teacher forcing of ``captions`` (N, T+1) on ``features`` (B, L, D) for a fixed T steps.

        ``image_index`` names each caption's image: a tensor (N,) any assignment, the features, keys and
        initial states of the B images computed once and gathered to the N captions; an int K, captions
        bK .. bK + K - 1 are image b's (N = B K), run as ``step`` runs K sequences per image, so that each
        attention read and its backward touch one copy of the image's features instead of K; None: K = 1.
        Either way the outputs are the same, row n caption n's. Pad steps run like the others (no per-step
        batch shrinking); the loss masks them.
        """
        images = features.size(0)  # B
        per_image = image_index if isinstance(image_index, int) and image_index > 1 else None  # K
        keys = self.attention.keys(features)  # (B, L, A), once per image
        state = self.init_state(features)  # (B, H) x 2
        sampling = self.mode == Attention.hard and self.training
        expect = None
        if sampling:  # per image, as the paper says: the expected context instead of a sampled location
            expect = torch.rand(images, device=features.device) < self.expectation_share  # (B,)
        if isinstance(image_index, Tensor):
            features, keys = features[image_index], keys[image_index]  # (N, L, D), (N, L, A)
            state = (state[0][image_index], state[1][image_index])  # (N, H) x 2
            expect = None if expect is None else expect[image_index]  # (N,)
        elif per_image is not None:
            # (B, K, H) x 2, contiguous as every later step's state: one compiled graph serves them all
            state = tuple(s.unsqueeze(1).expand(-1, per_image, -1).contiguous() for s in state)
            expect = None if expect is None else expect.unsqueeze(1).expand(-1, per_image)  # (B, K)
        embedded = self.embedding(captions[:, :-1])  # (N, T, E): E y_{t-1}
        if per_image is not None:
            embedded = embedded.view(images, per_image, *embedded.shape[1:])  # (B, K, T, E)
        steps = []
        for t in range(embedded.size(-2)):
            logits, state, alpha, log_prob, entropy = self._step(embedded[..., t, :], state, features, keys, expect)
            steps.append((logits, alpha, log_prob, entropy))
        logits, alphas, log_probs, entropies = (_by_caption(out, per_image is not None) for out in zip(*steps))
        output = DecoderOutput(logits, alphas)  # (N, T, V), (N, T, L)
        if sampling:
            if self.hard_estimator == HardEstimator.reinforce:
                output.location_log_probs = log_probs  # (N, T)
            output.entropy = entropies  # (N, T)
            output.sampled = ~expect.flatten()  # (N,)
        return output

    def _step(
        self, embedded: Tensor, state: State, features: Tensor, keys: Tensor, expect: Tensor | None
    ) -> StepOutput:
        """One word for the embedded previous words (B, [K,] E): compiled when ``compile_step`` asked."""
        if self.compiled_step is None:
            return self._eager_step(embedded, state, features, keys, expect)
        for tensor in (embedded, *state, features, keys, *([] if expect is None else [expect])):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)  # B (or N): the last batch, beams' images, captions
        inputs = (embedded, state, features, keys, expect)
        if DistributedDataParallel._get_active_ddp_module() is None:
            output = self.compiled_step(*inputs)
        else:
            # Inside DDP's forward dynamo hands a new graph to its DDPOptimizer, which splits it at gradient-bucket
            # boundaries so that a whole model compiled at once overlaps its all-reduces with the backward. Run T
            # times a forward, this step's parameters are ready only when the first step's backward is done, so
            # a split gains nothing, and the split fails ("output spec mismatch": a torch.Size crosses it). One
            # graph, with DDP's own reducer all-reducing the gradients as in eager mode.
            with torch._dynamo.config.patch(optimize_ddp=False):
                output = self.compiled_step(*inputs)
        if self.graphed and not torch.is_grad_enabled():
            # Without a backward to wait for, every call of a CUDA-graphed step starts a new iteration that
            # reuses the last one's output memory: the next word's inputs (the state) and what the loop keeps
            # (logits, alpha) must be copied out first.
            logits, (h, c), alpha, log_prob, entropy = output
            output = logits.clone(), (h.clone(), c.clone()), alpha.clone(), _clone(log_prob), _clone(entropy)
        return output

    def _eager_step(
        self, embedded: Tensor, state: State, features: Tensor, keys: Tensor, expect: Tensor | None
    ) -> StepOutput:
        h, c = state  # (B, H) x 2 or (B, K, H) x 2: h_{t-1}, c_{t-1}
        z, alpha, log_prob, entropy = self._attend(features, keys, h, expect)  # (B, [K,] D), (B, [K,] L)
        if self.f_beta is not None:
            z = torch.sigmoid(self.f_beta(h)) * z  # beta_t = sigmoid(f_beta(h_{t-1})) (section 4.2.1)
        inputs = torch.cat([embedded, z], dim=-1)  # eq. 1-3, input [E y_{t-1}; z_t]
        shape = h.shape  # the cell takes rows: (B * K, .) when there are K states per image
        h, c = self.lstm(inputs.reshape(-1, inputs.size(-1)), (h.reshape(-1, shape[-1]), c.reshape(-1, shape[-1])))
        h, c = h.view(shape), c.view(shape)
        if self.deep_h is None:
            logits = self.classifier(self.dropout(h))  # (B, [K,] V)
        else:  # eq. 7: L_o(E y_{t-1} + L_h h_t + L_z z_t)
            logits = self.classifier(self.dropout(embedded + self.deep_h(h) + self.deep_z(z)))  # (B, [K,] V)
        return logits, (h, c), alpha, log_prob, entropy

    def _attend(
        self, features: Tensor, keys: Tensor, h: Tensor, expect: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """z_t before gating (B, D), alpha_t (B, L) and, when sampling, log p(s_t) and H(alpha_t) (B,);
        with K states per image (B, K, H), each gains the K axis.

        With the Gumbel estimator log p(s_t) is None: the straight-through one-hot carries the gradient.
        """
        context, alpha = self.attention(keys, features, h)  # eq. 4-5; soft: expected context (section 4.2)
        if self.mode == Attention.soft or (not self.training and self.hard_read == HardInference.expectation):
            return context, alpha, None, None
        # each row's image, broadcast against the location indices (B,) or (B, K)
        images = torch.arange(features.size(0), device=features.device).view(-1, *[1] * (h.dim() - 2))
        if not self.training:  # hard attention at inference: the most likely location
            return features[images, alpha.argmax(dim=-1)], alpha, None, None
        locations = Categorical(probs=alpha, validate_args=False)
        if self.hard_estimator == HardEstimator.gumbel:
            z, log_prob = self._gumbel_location(alpha, features), None  # (B, [K,] D)
        else:
            s = locations.sample()  # (B, [K]): s_t ~ Multinoulli_L(alpha_t) (section 4.1)
            z = features[images, s]  # (B, [K,] D): z_t = a_{s_t}
            log_prob = locations.log_prob(s)  # (B, [K])
        if expect is not None:
            z = torch.where(expect.unsqueeze(-1), context, z)
            log_prob = None if log_prob is None else log_prob.masked_fill(expect, 0.0)
        return z, alpha, log_prob, locations.entropy()

    def _gumbel_location(self, alpha: Tensor, features: Tensor) -> Tensor:
        """z_t = a_{s_t} for s_t = argmax_i(log alpha_ti + g_i), g ~ Gumbel(0, 1), with the gradient of the
        relaxed weights softmax((log alpha_t + g) / tau) (straight-through Gumbel-softmax, Jang et al. 2017)."""
        weights = F.gumbel_softmax(alpha.clamp_min(1e-12).log(), tau=self.gumbel_tau, hard=True)  # (B, [K,] L)
        if weights.dim() == 2:
            return torch.bmm(weights.unsqueeze(1), features).squeeze(1)  # (B, D)
        return torch.bmm(weights, features)  # (B, K, D)


def _clone(tensor: Tensor | None) -> Tensor | None:
    """A copy of ``tensor`` (None stays None)."""
    return None if tensor is None else tensor.clone()


def _by_caption(steps: tuple[Tensor | None, ...], grouped: bool) -> Tensor | None:
    """T steps' outputs, each (N, ...) or, ``grouped``, (B, K, ...), stacked to (N, T, ...) with caption n = bK + k."""
    if steps[0] is None:
        return None
    if not grouped:
        return torch.stack(steps, dim=1)
    return torch.stack(steps, dim=2).flatten(0, 1)  # (B, K, T, ...) -> (N, T, ...)
