"""A model-free ``Engine`` over a seeded tree of reasoning steps, for exact tests of search.

Search strategies (MCTS, step beam, best-of-N, self-consistency) and VinePPO's Monte-Carlo
values are tested on CPU against a tree whose every probability and answer is known
(search_and_credit.md, "Toy tests on CPU, with no model" and the trap tree of section 7.3).

Vocabulary (``FakeTokenizer``; ids are module constants)::

    EOS = 0                      "<eos>" ("" with skip_special_tokens); also the pad id
    NL = 1                       "\\n"
    HASH = 2                     "#### "
    STEP0 + j, j < MAX_BRANCHING "s{j}."        the step to child j
    ANS0 + a, a < NUM_ANSWERS    "A{a}"         answer a: 0 = C (correct), 1 = W (systematic
                                                wrong), 2 .. 2 + N_SCATTERED - 1 scattered wrong
    PROMPT0 + i, i < MAX_PROBLEMS "Q{i}:"       the prompt of problem i
    STRADDLE                     ".\\n\\n"      splitter tests only; never sampled, never parsed

A response is a sequence of steps from the root. A step that does not reach the leaves is
``[STEP0 + j, NL]``; the step that reaches depth ``tree.depth`` is
``[STEP0 + j, HASH, ANS0 + a, EOS]`` with ``a`` the leaf's answer. A complete response thus
reads ``"s0.\\ns2.\\ns1.\\ns0.\\ns0.\\ns1.#### A0"``. A prompt is ``[PROMPT0 + problem]``
followed by the response so far, which must end on a step boundary (after an NL, or right
after the prompt token).

Log-probabilities are exact: a step token gets log q_j, q the node's child probabilities
tempered (q ∝ p^(1/T)); the deterministic tokens (NL, HASH, answer, EOS) get 0. As in
``HFEngine``, greedy (T = 0) takes the argmax child and reports the T = 1 log-probability,
and top-k / top-p truncate the sampling but not the reported log-probability.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relign.envs.base import Task
from relign.rollout.engine import Completion, Engine, SamplingParams, derive_seed
from relign.envs.tasks import Problem

# --------------------------------------------------------------------------- vocabulary

EOS = 0
NL = 1
HASH = 2
STEP0 = 3
MAX_BRANCHING = 8
"""Step tokens exist for child indices 0 .. MAX_BRANCHING - 1 (the trap tree uses 3)."""
ANS0 = STEP0 + MAX_BRANCHING  # 11
NUM_ANSWERS = 64
CORRECT = 0
"""Answer C ("A0"): the correct answer of every problem."""
WRONG = 1
"""Answer W ("A1"): the trap tree's systematic wrong answer."""
SCATTERED0 = 2
N_SCATTERED = 50
"""Scattered wrong answers are 2 .. 2 + N_SCATTERED - 1 ("A2" .. "A51")."""
PROMPT0 = ANS0 + NUM_ANSWERS  # 75
MAX_PROBLEMS = 10_000
STRADDLE = PROMPT0 + MAX_PROBLEMS  # 10075
VOCAB_SIZE = STRADDLE + 1
CORRECT_TEXT = "A0"


def step_token(j: int) -> int:
    return STEP0 + j


def answer_token(a: int) -> int:
    return ANS0 + a


def prompt_token(problem: int) -> int:
    if not 0 <= problem < MAX_PROBLEMS:
        raise ValueError(f"problem index {problem} outside [0, {MAX_PROBLEMS})")
    return PROMPT0 + problem


def token_text(tok: int, skip_special_tokens: bool = False) -> str:
    tok = int(tok)
    if tok == EOS:
        return "" if skip_special_tokens else "<eos>"
    if tok == NL:
        return "\n"
    if tok == HASH:
        return "#### "
    if STEP0 <= tok < ANS0:
        return f"s{tok - STEP0}."
    if ANS0 <= tok < PROMPT0:
        return f"A{tok - ANS0}"
    if PROMPT0 <= tok < STRADDLE:
        return f"Q{tok - PROMPT0}:"
    if tok == STRADDLE:
        return ".\n\n"
    raise ValueError(f"token id {tok} is not in the fake vocabulary (size {VOCAB_SIZE})")


_ENCODE_RE = re.compile(r"<eos>|Q\d+:|s\d+\.|A\d+|#### |\.\n\n|\n")


class FakeTokenizer:
    """Just enough of a Hugging Face tokenizer for the search code: ids <-> the texts above."""

    eos_token_id = EOS
    pad_token_id = EOS
    eos_token = "<eos>"
    pad_token = "<eos>"
    all_special_ids = [EOS]
    vocab_size = VOCAB_SIZE

    def __len__(self) -> int:
        return VOCAB_SIZE

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False, **_: Any) -> str:
        if isinstance(ids, int):
            ids = [ids]
        elif isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(token_text(t, skip_special_tokens) for t in ids)

    def batch_decode(self, seqs: Iterable[Iterable[int]], skip_special_tokens: bool = False, **kw: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kw) for s in seqs]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        if isinstance(ids, int):
            return token_text(ids)
        return [token_text(t) for t in ids]

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        """The inverse of ``decode`` (left to right, longest piece first); raises on other text."""
        ids, pos = [], 0
        for m in _ENCODE_RE.finditer(text):
            if m.start() != pos:
                raise ValueError(f"cannot encode {text[pos:m.start()]!r} in {text!r}")
            s = m.group()
            if s == "<eos>":
                ids.append(EOS)
            elif s == "\n":
                ids.append(NL)
            elif s == "#### ":
                ids.append(HASH)
            elif s == ".\n\n":
                ids.append(STRADDLE)
            elif s[0] == "Q":
                ids.append(prompt_token(int(s[1:-1])))
            elif s[0] == "s":
                j = int(s[1:-1])
                if j >= MAX_BRANCHING:
                    raise ValueError(f"no step token for child {j}")
                ids.append(STEP0 + j)
            else:
                a = int(s[1:])
                if a >= NUM_ANSWERS:
                    raise ValueError(f"no answer token for answer {a}")
                ids.append(ANS0 + a)
            pos = m.end()
        if pos != len(text):
            raise ValueError(f"cannot encode {text[pos:]!r} in {text!r}")
        return ids


# --------------------------------------------------------------------------- trees

Path = tuple[int, ...]


@dataclass
class TreeSpec:
    """A complete ``branching``-ary tree of depth ``depth`` for one problem, built eagerly from
    ``random.Random(derive_seed(seed, problem))`` (one tree costs about a millisecond at depth
    6, branching 3; the node count grows as branching ** depth).

    Nodes are paths: tuples of child indices from the root ``()``. An internal node has child
    probabilities (``root_probs`` at the root if given, else Dirichlet(alpha)); a leaf (depth
    ``depth``) has an answer: under root child b it is C with probability
    ``branch_p_correct[b]``, else W if ``branch_systematic[b]`` else a uniformly drawn scattered
    wrong answer.
    """

    problem: int
    seed: int = 0
    depth: int = 6
    branching: int = 3
    root_probs: list[float] | None = None
    alpha: float = 1.0
    branch_p_correct: list[float] = field(default_factory=lambda: [0.1, 0.7, 0.3])
    branch_systematic: list[bool] = field(default_factory=lambda: [True, False, False])
    n_scattered: int = N_SCATTERED
    _probs: dict[Path, list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _answers: dict[Path, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _memo: dict[tuple[Path, float], dict[int, float]] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)
    _pc_memo: dict[tuple[Path, int, float], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.problem < MAX_PROBLEMS:
            raise ValueError(f"problem {self.problem} outside [0, {MAX_PROBLEMS})")
        if self.depth < 1:
            raise ValueError("depth must be >= 1")
        if not 1 <= self.branching <= MAX_BRANCHING:
            raise ValueError(f"branching must be in [1, {MAX_BRANCHING}]")
        if len(self.branch_p_correct) != self.branching or len(self.branch_systematic) != self.branching:
            raise ValueError("branch_p_correct and branch_systematic need one entry per root child")
        if not 1 <= self.n_scattered <= NUM_ANSWERS - SCATTERED0:
            raise ValueError(f"n_scattered must be in [1, {NUM_ANSWERS - SCATTERED0}]")
        if self.root_probs is not None:
            if len(self.root_probs) != self.branching or any(p < 0 for p in self.root_probs):
                raise ValueError("root_probs: one non-negative probability per child")
            s = float(sum(self.root_probs))
            self.root_probs = [float(p) / s for p in self.root_probs]
        rng = random.Random(derive_seed(self.seed, self.problem))
        self._build(rng, ())

    def _build(self, rng: random.Random, path: Path) -> tuple[float, float]:
        """Draws the subtree of ``path``; returns its (P(C), P(W)) at temperature 1."""
        if len(path) == self.depth:
            b = path[0]
            if rng.random() < self.branch_p_correct[b]:
                a = CORRECT
            elif self.branch_systematic[b]:
                a = WRONG
            else:
                a = SCATTERED0 + rng.randrange(self.n_scattered)
            self._answers[path] = a
            pc, pw = float(a == CORRECT), float(a == WRONG)
            self._pc_memo[(path, CORRECT, 1.0)] = pc
            self._pc_memo[(path, WRONG, 1.0)] = pw
            return pc, pw
        if not path and self.root_probs is not None:
            probs = list(self.root_probs)
        else:
            if self.alpha == 1.0:  # Gamma(1) = Exp(1), and cheaper
                g = [-math.log(1.0 - rng.random()) for _ in range(self.branching)]
            else:
                g = [rng.gammavariate(self.alpha, 1.0) for _ in range(self.branching)]
            s = sum(g)
            probs = [x / s for x in g]
        self._probs[path] = probs
        pc = pw = 0.0
        for j in range(self.branching):
            c, w = self._build(rng, path + (j,))
            pc += probs[j] * c
            pw += probs[j] * w
        self._pc_memo[(path, CORRECT, 1.0)] = pc
        self._pc_memo[(path, WRONG, 1.0)] = pw
        return pc, pw

    # ------------------------------------------------------------------ queries
    def is_leaf(self, path: Sequence[int]) -> bool:
        return len(self._check(path)) == self.depth

    def probs(self, path: Sequence[int], temperature: float = 1.0) -> list[float]:
        """Child probabilities of an internal node, tempered (∝ p^(1/T); T = 0: one-hot argmax)."""
        path = self._check(path)
        if len(path) == self.depth:
            raise ValueError(f"node {path} is a leaf: it has no children")
        return temper(self._probs[path], temperature)

    def leaf_answer(self, path: Sequence[int]) -> int:
        path = self._check(path)
        if len(path) != self.depth:
            raise ValueError(f"node {path} is not a leaf (depth {len(path)} < {self.depth})")
        return self._answers[path]

    def answer_probs(self, path: Sequence[int] = (), temperature: float = 1.0) -> dict[int, float]:
        """Exact distribution of the final answer when sampling from ``path`` at ``temperature``."""
        path = self._check(path)
        key = (path, float(temperature))
        out = self._memo.get(key)
        if out is None:
            if len(path) == self.depth:
                out = {self._answers[path]: 1.0}
            else:
                out = {}
                for j, q in enumerate(temper(self._probs[path], temperature)):
                    if q > 0:
                        for a, pa in self.answer_probs(path + (j,), temperature).items():
                            out[a] = out.get(a, 0.0) + q * pa
            self._memo[key] = out
        return out

    def p_correct(self, path: Sequence[int] = (), temperature: float = 1.0) -> float:
        """The true value V of a node: P(sampling from it at ``temperature`` ends in C)."""
        return self._pa(self._check(path), CORRECT, float(temperature))

    def p_answer(self, path: Sequence[int], answer: int, temperature: float = 1.0) -> float:
        """P(sampling from ``path`` at ``temperature`` ends in ``answer``)."""
        return self._pa(self._check(path), int(answer), float(temperature))

    def _pa(self, path: Path, answer: int, temperature: float) -> float:
        key = (path, answer, temperature)
        v = self._pc_memo.get(key)
        if v is None:
            if len(path) == self.depth:
                v = 1.0 if self._answers[path] == answer else 0.0
            else:
                q = self._probs[path] if temperature == 1.0 else temper(self._probs[path], temperature)
                v = sum(qj * self._pa(path + (j,), answer, temperature) for j, qj in enumerate(q) if qj > 0)
            self._pc_memo[key] = v
        return v

    def best_path(self) -> Path:
        """A path to a leaf that maximises p_correct at every step (ties: lowest index)."""
        path: Path = ()
        while len(path) < self.depth:
            vals = [self.p_correct(path + (j,)) for j in range(self.branching)]
            path += (max(range(self.branching), key=lambda j: (vals[j], -j)),)
        return path

    def leaves(self) -> list[Path]:
        return sorted(self._answers)

    # ------------------------------------------------------------------ tokens / text
    def step_ids(self, path: Sequence[int], j: int) -> list[int]:
        """The tokens of the step from ``path`` to its child ``j``."""
        path = self._check(path)
        if len(path) >= self.depth or not 0 <= j < self.branching:
            raise ValueError(f"no step {j} from node {path}")
        if len(path) + 1 < self.depth:
            return [STEP0 + j, NL]
        return [STEP0 + j, HASH, ANS0 + self._answers[path + (j,)], EOS]

    def response_ids(self, path: Sequence[int]) -> list[int]:
        """The response tokens that reach ``path`` from the root (ends with EOS at a leaf)."""
        path = self._check(path)
        out: list[int] = []
        for d, j in enumerate(path):
            out += self.step_ids(path[:d], j)
        return out

    def prefix_ids(self, path: Sequence[int] = ()) -> list[int]:
        """Prompt plus response: what the engine continues to sample below ``path``."""
        return [PROMPT0 + self.problem, *self.response_ids(path)]

    def step_texts(self, path: Sequence[int]) -> list[str]:
        """The steps reaching ``path`` as texts (``["s0.\\n", ..., "s1.#### A0"]``)."""
        path = self._check(path)
        return [_TOK.decode(self.step_ids(path[:d], j), skip_special_tokens=True) for d, j in enumerate(path)]

    def parse(self, response_ids: Sequence[int]) -> Path:
        """The node a response prefix reaches; ValueError unless it ends on a step boundary."""
        path: list[int] = []
        ids = [int(t) for t in response_ids]
        i = 0
        while i < len(ids):
            if len(path) == self.depth:
                raise ValueError(f"tokens {ids[i:]} after a complete response")
            j = ids[i] - STEP0
            if not 0 <= j < self.branching:
                raise ValueError(f"expected a step token at position {i}, got {ids[i]} in {ids}")
            want = self.step_ids(path, j)
            got = ids[i : i + len(want)]
            if got != want:
                what = "ends in the middle of a step" if want[: len(got)] == got else "is malformed"
                raise ValueError(f"response prefix {ids} {what} at position {i} (expected {want})")
            path.append(j)
            i += len(want)
        return tuple(path)

    def _check(self, path: Sequence[int]) -> Path:
        path = tuple(int(j) for j in path)
        if len(path) > self.depth or any(not 0 <= j < self.branching for j in path):
            raise ValueError(f"no node {path} in a tree of depth {self.depth}, branching {self.branching}")
        return path


_TOK = FakeTokenizer()


def temper(probs: Sequence[float], temperature: float) -> list[float]:
    """p^(1/T) normalised; T = 0: one-hot on the argmax (lowest index on ties)."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if temperature == 0:
        k = max(range(len(probs)), key=lambda j: (probs[j], -j))
        return [1.0 if j == k else 0.0 for j in range(len(probs))]
    if temperature == 1.0:
        return list(probs)
    logs = [math.log(p) / temperature if p > 0 else -math.inf for p in probs]
    m = max(logs)
    w = [math.exp(x - m) if x > -math.inf else 0.0 for x in logs]
    s = sum(w)
    return [x / s for x in w]


def trap_tree(problem: int, seed: int = 0) -> TreeSpec:
    """The trap tree of search_and_credit.md 7.3: depth 6, 3 steps per node, root [0.6, 0.25,
    0.15], Dirichlet(1,1,1) below; leaves under root child 0 are C w.p. 0.1 else W, under child
    1 C w.p. 0.7, under child 2 C w.p. 0.3, else scattered. E P(C) = 0.28, E P(W) = 0.54."""
    return TreeSpec(problem=problem, seed=seed, depth=6, branching=3, root_probs=[0.6, 0.25, 0.15], alpha=1.0,
                    branch_p_correct=[0.1, 0.7, 0.3], branch_systematic=[True, False, False])


def random_tree(problem: int, seed: int = 0, depth: int = 4, branching: int = 3, *, p_correct: float = 0.5,
                alpha: float = 1.0, root_probs: Sequence[float] | None = None, systematic: bool = False,
                n_scattered: int = N_SCATTERED) -> TreeSpec:
    """A general tree: Dirichlet(alpha) steps everywhere (or ``root_probs`` at the root); every
    leaf is C w.p. ``p_correct``, else W (``systematic``) or a scattered wrong answer."""
    return TreeSpec(problem=problem, seed=seed, depth=depth, branching=branching,
                    root_probs=None if root_probs is None else list(root_probs), alpha=alpha,
                    branch_p_correct=[p_correct] * branching, branch_systematic=[systematic] * branching,
                    n_scattered=n_scattered)


class TreeBank:
    """Problem index -> TreeSpec, built on first use and cached (share one between the engine
    and the scorers so each tree is built once)."""

    def __init__(self, trees: TreeBank | Mapping[int, TreeSpec] | Callable[[int], TreeSpec]):
        if isinstance(trees, TreeBank):
            self._factory, self._cache = trees._factory, trees._cache
        elif isinstance(trees, Mapping):
            self._factory, self._cache = None, dict(trees)
        elif callable(trees):
            self._factory, self._cache = trees, {}
        else:
            raise TypeError("trees: a dict problem -> TreeSpec, or a callable problem -> TreeSpec")

    def __call__(self, problem: int) -> TreeSpec:
        tree = self._cache.get(problem)
        if tree is None:
            if self._factory is None:
                raise KeyError(f"no tree for problem {problem}")
            tree = self._cache[problem] = self._factory(problem)
        return tree

    __getitem__ = __call__


def trap_trees(seed: int = 0) -> TreeBank:
    return TreeBank(lambda i: trap_tree(i, seed))


# --------------------------------------------------------------------------- engine


class FakeTreeEngine(Engine):
    """The ``Engine`` protocol over ``TreeSpec`` trees: exact token ids and log-probabilities.

    Seeding: with ``seeds``, completion j of prompt i draws from ``random.Random(derive_seed(
    seeds[i], j))`` only; else from one ``random.Random(params.seed)`` for the call when set,
    else from the engine's own stream (kept in ``state_dict``), prompt by prompt in order.

    Counters: ``calls`` (generate calls), ``prompts_seen`` (prompts over all calls),
    ``tokens_generated`` (sum of ``len(token_ids)`` returned), ``call_log`` ((prompts, n) per
    call), ``weight_loads``, ``sleeping``.
    """

    def __init__(self, trees: TreeBank | Mapping[int, TreeSpec] | Callable[[int], TreeSpec] | None = None,
                 tokenizer: FakeTokenizer | None = None, seed: int = 0):
        self.trees = TreeBank(trees if trees is not None else trap_trees(0))
        self.tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
        self._rng = random.Random(seed)
        self.calls = 0
        self.prompts_seen = 0
        self.tokens_generated = 0
        self.call_log: list[tuple[int, int]] = []
        self.weight_loads = 0
        self.sleeping = False

    weight_format = "trainer"
    """The Engine protocol's attribute: ``load_weights`` takes trainer names (only counted here)."""

    # ------------------------------------------------------------------ parsing
    def node_of(self, prompt_ids: Sequence[int]) -> tuple[int, Path]:
        """(problem, path) of a prompt: ``[PROMPT0 + problem] + response so far``."""
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt")
        first = int(prompt_ids[0])
        if not PROMPT0 <= first < STRADDLE:
            raise ValueError(f"a prompt must start with a problem token, got {first}")
        problem = first - PROMPT0
        return problem, self.trees(problem).parse(prompt_ids[1:])

    # ------------------------------------------------------------------ Engine protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int] | None = None
                 ) -> list[list[Completion]]:
        if params.ignore_eos:
            raise NotImplementedError("FakeTreeEngine: ignore_eos is not supported")
        if params.min_new_tokens > 0:
            raise NotImplementedError("FakeTreeEngine: min_new_tokens > 0 is not supported")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
        nodes = [self.node_of(p) for p in prompts]  # validate every prompt before sampling any
        for (problem, path) in nodes:
            if len(path) == self.trees(problem).depth:
                raise ValueError(f"problem {problem}: the prompt already holds a complete response {path}")
        n = max(1, params.n)
        self.calls += 1
        self.prompts_seen += len(prompts)
        self.call_log.append((len(prompts), n))
        call_rng = random.Random(params.seed) if params.seed is not None else self._rng
        out: list[list[Completion]] = []
        for i, (problem, path) in enumerate(nodes):
            tree = self.trees(problem)
            row = []
            for j in range(n):
                rng = random.Random(derive_seed(seeds[i], j)) if seeds is not None else call_rng
                c = self._sample(tree, path, params, rng)
                self.tokens_generated += len(c.token_ids)
                row.append(c)
            out.append(row)
        return out

    def _sample(self, tree: TreeSpec, path: Path, params: SamplingParams, rng: random.Random) -> Completion:
        T = params.temperature
        stop_ids = {EOS, *params.stop_token_ids}
        stops = [s for s in params.stop if s]
        tail = max((len(s) for s in stops), default=0) + 8
        toks: list[int] = []
        lps: list[float] = []
        finish: str | None = None
        reason: str | int | None = None
        node = path
        while finish is None:
            p = tree._probs[node]
            j, lp = _pick(p, T, params.top_k, params.top_p, rng)
            step = tree.step_ids(node, j)
            node = node + (j,)
            for k, tok in enumerate(step):
                toks.append(tok)
                lps.append(lp if k == 0 else 0.0)
                if tok in stop_ids:
                    finish, reason = "stop", tok
                elif stops:
                    text = self.tokenizer.decode(toks[-tail:], skip_special_tokens=True)
                    hit = next((s for s in stops if s in text), None)
                    if hit is not None:
                        finish, reason = "stop", hit
                if finish is None and len(toks) >= params.max_new_tokens:
                    finish = "length"
                if finish is not None:
                    break
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        if isinstance(reason, str) and reason in text:
            text = text[: text.find(reason)]
        return Completion(token_ids=toks, logps=lps, finish_reason=finish, text=text, stop_reason=reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:
            pass
        self.weight_loads += 1

    def sleep(self) -> None:
        self.sleeping = True

    def wake(self) -> None:
        self.sleeping = False

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": torch.tensor(list(internal), dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._rng.setstate((3, tuple(int(x) for x in state["rng"].tolist()), None))


def _pick(p: Sequence[float], T: float, top_k: int, top_p: float, rng: random.Random) -> tuple[int, float]:
    """(child, reported log-prob): sampled from the tempered, top-k/top-p truncated probabilities."""
    if T == 0:
        j = max(range(len(p)), key=lambda k: (p[k], -k))
        return j, math.log(p[j])
    q = temper(p, T)
    w = list(q)
    order = sorted(range(len(q)), key=lambda k: (-q[k], k))
    if top_k and top_k < len(q):
        for k in order[top_k:]:
            w[k] = 0.0
    if top_p < 1.0:
        before = 0.0
        for r, k in enumerate(order):
            if r > 0 and before >= top_p:
                w[k] = 0.0
            before += q[k]
    s = sum(w)
    u = rng.random() * s
    acc, j = 0.0, None
    for k, x in enumerate(w):
        if x > 0:
            j = k
            acc += x
            if u < acc:
                break
    assert j is not None
    return j, math.log(q[j])


def trap_engine(tree_seed: int = 0, engine_seed: int = 0) -> FakeTreeEngine:
    return FakeTreeEngine(trap_trees(tree_seed), FakeTokenizer(), seed=engine_seed)


# --------------------------------------------------------------------------- scorers

_PROBLEM_RE = re.compile(r"Q(\d+):")
_STEP_RE = re.compile(r"s(\d+)\.")
_FINAL_RE = re.compile(r"####\s*A(\d+)")


def parse_problem(text: str) -> int:
    m = _PROBLEM_RE.search(text)
    if m is None:
        raise ValueError(f"no problem tag 'Q<i>:' in {text!r}")
    return int(m.group(1))


def parse_steps(tree: TreeSpec, steps: Sequence[str]) -> list[tuple[Path, bool]]:
    """For each step text, (the node after it, whether the solution is complete there).

    Lenient: whitespace is ignored, a step text may hold several steps ("s0.\\ns1.") or none
    (then it stays at the node before it), and a final step holds "#### A<a>", which must be
    the leaf's answer. Anything else raises ValueError.
    """
    path: list[int] = []
    done = False
    out: list[tuple[Path, bool]] = []
    for s in steps:
        body = s.strip()
        hash_at = body.find("####")
        head = body if hash_at < 0 else body[:hash_at]
        pos = 0
        for m in _STEP_RE.finditer(head):
            if head[pos:m.start()].strip():
                raise ValueError(f"cannot parse step text {s!r}")
            if done or len(path) >= tree.depth:
                raise ValueError(f"step {m.group()!r} after a complete solution: {list(steps)!r}")
            j = int(m.group(1))
            if not 0 <= j < tree.branching:
                raise ValueError(f"no child {j} in step {s!r}")
            path.append(j)
            pos = m.end()
        if head[pos:].strip():
            raise ValueError(f"cannot parse step text {s!r}")
        if hash_at >= 0:
            m = _FINAL_RE.fullmatch(body[hash_at:].strip())
            if m is None:
                raise ValueError(f"cannot parse the final answer in {s!r}")
            if done or len(path) != tree.depth:
                raise ValueError(f"an answer at depth {len(path)} < {tree.depth}: {list(steps)!r}")
            if int(m.group(1)) != tree.leaf_answer(path):
                raise ValueError(f"answer A{m.group(1)} is not leaf {tuple(path)}'s answer A{tree.leaf_answer(path)}")
            done = True
        out.append((tuple(path), done))
    return out


def _gauss(*parts: int) -> float:
    """A standard normal draw fixed by ``parts`` (Box-Muller on two splitmix64 uniforms)."""
    u1 = (derive_seed(*parts, 1) + 0.5) / 2.0**63
    u2 = derive_seed(*parts, 2) / 2.0**63
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


class _TreeScorer:
    """Scores each step of each (partial) solution by the node it reaches (subclasses say how)."""

    tag = 0
    needs_reference = False

    def __init__(self, trees, seed: int = 0):
        self.trees = TreeBank(trees)
        self.seed = seed
        self.calls = 0
        self.scored = 0

    def score(self, problems: list[str], steps: list[list[str]], extra_infos: list[dict] | None = None
              ) -> list[list[float]]:
        if len(problems) != len(steps):
            raise ValueError(f"{len(problems)} problems but {len(steps)} step lists")
        self.calls += 1
        self.scored += len(problems)
        out = []
        for prob_text, st in zip(problems, steps):
            problem = parse_problem(prob_text)
            tree = self.trees(problem)
            out.append([self.node_score(tree, path, done) for path, done in parse_steps(tree, st)])
        return out

    def noise(self, tree: TreeSpec, path: Path, done: bool, sd: float) -> float:
        if sd == 0:
            return 0.0
        return sd * _gauss(self.tag, self.seed, tree.seed, tree.problem, int(done), len(path), *path)

    def node_score(self, tree: TreeSpec, path: Path, done: bool) -> float:
        raise NotImplementedError


class OracleValue(_TreeScorer):
    """A value model: the true p_correct of each prefix (+ N(0, noise_sd), fixed per node), and
    for a complete solution its correctness 1/0 (+ noise)."""

    tag = 101

    def __init__(self, trees, noise_sd: float = 0.0, seed: int = 0):
        super().__init__(trees, seed)
        self.noise_sd = float(noise_sd)

    def node_score(self, tree: TreeSpec, path: Path, done: bool) -> float:
        v = (1.0 if tree.leaf_answer(path) == CORRECT else 0.0) if done else tree.p_correct(path)
        return v + self.noise(tree, path, done, self.noise_sd)


class NoisyVerifier(_TreeScorer):
    """The spec's noisy scorer: a complete solution scores N(mean_correct, sd) if its answer is C
    else N(mean_wrong, sd); a partial one scores p_correct + N(0, sd). Fixed per node."""

    tag = 202

    def __init__(self, trees, mean_correct: float = 0.7, mean_wrong: float = 0.4, sd: float = 0.2, seed: int = 0):
        super().__init__(trees, seed)
        self.mean_correct, self.mean_wrong, self.sd = float(mean_correct), float(mean_wrong), float(sd)

    def node_score(self, tree: TreeSpec, path: Path, done: bool) -> float:
        if done:
            mean = self.mean_correct if tree.leaf_answer(path) == CORRECT else self.mean_wrong
        else:
            mean = tree.p_correct(path)
        # a verifier's P(Yes): the noisy score clipped to [0, 1], a weight a vote can sum
        return min(1.0, max(0.0, mean + self.noise(tree, path, done, self.sd)))


class ExactVerifier(_TreeScorer):
    """1/0 correctness of a complete solution; the exact p_correct of a partial one."""

    tag = 303

    def __init__(self, trees, seed: int = 0):
        super().__init__(trees, seed)

    def node_score(self, tree: TreeSpec, path: Path, done: bool) -> float:
        if done:
            return 1.0 if tree.leaf_answer(path) == CORRECT else 0.0
        return tree.p_correct(path)


# --------------------------------------------------------------------------- task and problems


def toy_answer(response: str, extra_info: dict | None = None) -> str | None:
    """The text after the last "####", stripped ("A0"); None without one."""
    if "####" not in response:
        return None
    out = response.rsplit("####", 1)[1].replace("<eos>", "").strip()
    return out or None


def toy_reward(prompt: str, response: str, extra_info: dict, **kw: Any) -> float:
    return 1.0 if toy_answer(response) == extra_info["answer"] else 0.0


def fake_task() -> Task:
    return Task(name="fake_tree", parse_row=lambda raw, src, row: ({}, {}), template="",
                reward_spec="tests.strategies.fake_tree_engine:toy_reward",
                extract_spec="tests.strategies.fake_tree_engine:toy_answer",
                answer_marker="####", reward_needs_reference=True)


def toy_problems(n: int, seed: int = 0, first: int = 0) -> list[Problem]:
    """Problems first .. first + n - 1 (``seed`` is unused: the trees hold the randomness)."""
    return [Problem(id=i, prompt_ids=[PROMPT0 + i], prompt_text=f"Q{i}:", question=f"Q{i}:",
                    extra_info={"answer": CORRECT_TEXT}) for i in range(first, first + n)]
