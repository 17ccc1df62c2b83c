"""GEM's games as relign multi-turn environments (``task.name=gem``), stateless by replay.

GEM (``pip install "relign[gem]"``, https://github.com/axon-rl/gem) is gym-like:
``env = gem.make(env_id, **kw)``, ``obs, info = env.reset(seed)``, ``obs, reward, terminated,
truncated, info = env.step(action)``. relign's contract (``relign.envs.env``) is stateless:
``step(state, action, extra_info)``. ``GemEnv.step`` therefore rebuilds the game each turn and
replays the episode::

    env = gem.make(env_id, **kwargs); env.reset(seed=s_i)     # the record's game
    for a in extra_info["gem"]["actions"]: env.step(a)        # the episode so far
    obs, r, terminated, truncated, _ = env.step(action)        # this turn

    next_state = state + action + wrap(obs)      reward = r      done = terminated or truncated
    score = [done and r >= success_reward]       extra_info: a new dict with a new actions list

What GEM does that this guards against (read in gem-llm 0.1.0's source):

* ``Env.reset(seed)`` calls ``random.seed`` and ``np.random.seed`` (``gem.utils.seeding``), the
  games draw from the global ``random`` (in ``__init__``, which resets once without a seed, and in
  ``step``: Minesweeper places its mines on the first reveal). Every make/reset/replay runs in
  ``rng_guard``, which saves and restores both global generators, so the trainer's streams never
  move, and randomness inside ``step`` is a function of (seed, action history): replay is exact.
* It has no state copy (``spawn`` is defined by two envs only), hence the replay: O(T^2) steps of
  pure Python per episode, nothing held between calls, safe under the driver's ``asyncio.gather``,
  deterministic on resume and over ranks.
* ``import gem`` runs ``logging.basicConfig(level=INFO)`` on the root logger: ``_gem`` restores
  the root logger's level and handlers afterwards.
* Wordle and Hangman call ``nltk.download`` in ``__init__``; ``math:``/``qa:``/``code:`` ids load hub
  data. Construction runs with the network refused (``_offline``: a connection attempt raises at
  once, it never waits on a timeout) and such a game is a one-line ``ConfigError``.
* ``rg:`` ids wrap reasoning-gym single-turn: relign grades reasoning-gym natively
  (``task.name=reasoning_gym``), so they are refused with that pointer.

The G episodes of a GRPO group share their record's seed, so they play the same hidden number
or board (what a group baseline compares); the driver gives each episode its own shallow copy of
``extra_info``, so ``step`` never mutates the nested action list in place (copy-on-write).

Observations extend the text, so every state is a prefix of the next (the driver appends the
observation as masked tokens): raw text appends ``"\\n" + obs + "\\n"``; chat mode wraps it in the
tokenizer's own turn markup (``chat_observation``), derived once from its chat template.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any


from relign.envs.base import Task, generated, rng_guard
from relign.errors import ConfigError

NAME = "gem"
INSTALL = 'pip install "relign[gem]"'
_SENTINELS = ("\u2063X\u2063", "\u2063Y\u2063", "\u2063OBS\u2063")  # texts no template adds itself


# --------------------------------------------------------------------------- guards


@contextlib.contextmanager
def _offline() -> Iterator[list[str]]:
    """Refuse every network connection while a game is built (a download fails at once instead of
    hanging on a timeout); yields the list of addresses that were tried."""
    tried: list[str] = []

    def refuse(*args: Any, **_: Any):
        tried.append(str(args[0]) if args else "?")
        raise OSError("relign runs offline: no network while a GEM environment is built")

    saved = socket.getaddrinfo, socket.create_connection, socket.socket.connect
    socket.getaddrinfo, socket.create_connection = refuse, refuse
    socket.socket.connect = lambda self, address: refuse(address)
    try:
        yield tried
    finally:
        socket.getaddrinfo, socket.create_connection, socket.socket.connect = saved


def _gem():
    """The gem package, imported with the root logger kept as it was (``import gem`` calls
    ``logging.basicConfig(level=INFO)``)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        with rng_guard():
            return importlib.import_module("gem")
    except ImportError:
        raise ConfigError(f"task.name={NAME} needs the gem-llm package: {INSTALL}") from None
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def _registry() -> dict[str, Any]:
    _gem()
    return importlib.import_module("gem.envs.registration").ENV_REGISTRY


def check_env_id(env_id: str) -> None:
    """One ``ConfigError`` line for an id GEM does not register (closest ids named) or an ``rg:`` id."""
    if env_id.startswith("rg:"):
        raise ConfigError(f"task.gem.env_id={env_id}: relign grades reasoning-gym natively; use "
                          f"task.name=reasoning_gym task.rg.datasets='{{{env_id[3:]}: 1}}'")
    known = sorted(_registry())
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(known)} are registered (gem.print_envs())"
        raise ConfigError(f"task.gem.env_id: unknown GEM environment '{env_id}'{hint}")


def make_game(env_id: str, kwargs: dict[str, Any], *, offline: bool = True):
    """``gem.make(env_id, **kwargs)`` (offline unless told; callers hold ``rng_guard`` when they go on
    to reset and step it); a game that cannot be built is one ``ConfigError`` line. A step builds
    its game with ``offline=False``: the socket guard is process-wide, and a tracker's thread may
    be talking to its server while the driver steps (the game was built offline at load time)."""
    gem = _gem()
    with _offline() if offline else contextlib.nullcontext([]) as tried:
        try:
            return gem.make(env_id, **kwargs)
        except Exception as e:
            if tried or isinstance(e, (LookupError, OSError)):
                raise ConfigError(f"task.gem.env_id={env_id} needs a download at construction; relign runs offline "
                                  f"({type(e).__name__})") from None
            msg = " ".join(str(e).split())[:200]
            raise ConfigError(f"task.gem: gem.make({env_id!r}, **{kwargs}) failed: {type(e).__name__}: {msg}") from None


def play(env_id: str, kwargs: dict[str, Any], seed: int, actions: list[str], *,
         offline: bool = True) -> tuple[str, tuple | None]:
    """Build the game, reset it with ``seed`` and play ``actions``: (the first observation, the
    last step's ``(obs, reward, terminated, truncated, info)`` or None without actions). The
    global generators are as they were afterwards."""
    with rng_guard():
        env = make_game(env_id, kwargs, offline=offline)
        obs, _ = env.reset(seed=seed)
        last = None
        for a in actions:
            last = env.step(a)
    return str(obs), last


# --------------------------------------------------------------------------- records


def game_seed(seed: int, index: int) -> int:
    """Record ``index``'s game seed under base ``seed``: a hash, below 2**32 (``np.random.seed``'s range)."""
    digest = hashlib.blake2b(f"gem:{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (1 << 32)


def generate(n: int, seed: int, *, chat: bool = False, env_id: str = "", kwargs: dict[str, Any] | None = None,
             success_reward: float = 1.0, system_prompt: str = "") -> list[dict[str, Any]]:
    """``n`` games: record i resets with ``game_seed(seed, i)`` and its first observation is the prompt.

    ``extra_info["problem_key"]`` (the env id and the seed) identifies the game for the
    train/held-out split: the first observation of most games is the same text for every seed."""
    kwargs = dict(kwargs or {})
    check_env_id(env_id)
    records = []
    for i in range(n):
        s = game_seed(seed, i)
        obs0, _ = play(env_id, kwargs, s, [])
        if chat:
            sys_msg = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompt: dict[str, Any] = {"messages": [*sys_msg, {"role": "user", "content": obs0}]}
        else:
            prompt = {"prompt": f"{system_prompt}\n\n{obs0}" if system_prompt else obs0}
        info = {"env_id": env_id, "kwargs": kwargs, "seed": s, "actions": [], "chat": bool(chat),
                "success_reward": float(success_reward)}
        records.append({**prompt, "extra_info": {"gem": info, "problem_key": f"{env_id}#{s}"}})
    return records


# --------------------------------------------------------------------------- the environment


def chat_observation(tokenizer) -> tuple[str, str]:
    """(head, tail) such that ``head + obs + tail`` continues a chat after the model's turn with a
    user turn holding ``obs`` and the assistant's header, as the tokenizer's chat template renders
    it; ``ConfigError`` naming the tokenizer when that template re-renders earlier turns (no prefix)."""
    x, y, o = _SENTINELS
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    try:
        a = tokenizer.apply_chat_template([{"role": "user", "content": x}, {"role": "assistant", "content": y}],
                                          tokenize=False)
        b = tokenizer.apply_chat_template([{"role": "user", "content": x}, {"role": "assistant", "content": y},
                                           {"role": "user", "content": o}], tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise ConfigError(f"task.name={NAME} task.chat=true: the tokenizer {name} renders no chat ({type(e).__name__})") from None
    cut = a.find(y) + len(y)
    if a.find(y) < 0 or not b.startswith(a[:cut]) or b.count(o) != 1:
        raise ConfigError(f"task.name={NAME} task.chat=true: the chat template of {name} re-renders earlier turns, so an "
                          "observation cannot extend the conversation; use task.chat=false")
    head, tail = b[cut:].split(o)
    return head, tail


class GemEnv:
    """Implements ``relign.envs.env.Env`` for GEM games; stateless (each ``step`` replays the episode)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._chat: tuple[str, str] | None = None

    def wrap(self, obs: str, action: str, chat: bool) -> str:
        """The text that follows the model's ``action``: the observation as the next user turn."""
        if not chat:
            return "\n" + obs + "\n"
        if self._chat is None:
            if self.tokenizer is None:
                raise ConfigError(f"task.name={NAME} task.chat=true needs the tokenizer (GemEnv(tokenizer=...))")
            self._chat = chat_observation(self.tokenizer)
        head, tail = self._chat
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        if eos and head.startswith(eos) and action.endswith(eos):
            head = head[len(eos):]  # the model closed its turn itself (the engine keeps the EOS text)
        return head + obs + tail

    async def step(self, state: str, action: str, extra_info: dict) -> dict:
        g = extra_info["gem"]
        actions = [*g["actions"], action]  # a new list: the episodes of a group share the record's
        _, (obs, r, terminated, truncated, _) = play(g["env_id"], g["kwargs"], int(g["seed"]), actions, offline=False)
        done = bool(terminated or truncated)
        info = {**extra_info, "gem": {**g, "actions": actions}}
        if done and truncated:
            info["finish_reason"] = "max_turns"  # the game's own turn limit (relign.envs.env)
        r = float(r)
        return {"next_state": state + action + self.wrap(str(obs), action, bool(g.get("chat"))), "reward": r,
                "score": float(done and r >= float(g.get("success_reward", 1.0))), "done": done, "extra_info": info}


# --------------------------------------------------------------------------- the task


def task(*, chat: bool = False, system_prompt: str | None = None, gem: dict[str, Any] | None = None, **_: Any) -> Task:
    """The ``gem`` task from ``task.gem`` (``GemConfig`` as a dict): the env id is checked and the game
    built once here, so a bad id, bad options or a game that downloads fail before a model loads."""
    opts = dict(gem or {})
    env_id = str(opts.get("env_id") or "game:GuessTheNumber-v0-easy")
    kwargs = dict(opts.get("kwargs") or {})
    check_env_id(env_id)
    with rng_guard():
        game = make_game(env_id, kwargs)
    # rollout.max_turns=0 takes the game's own limit: every game of gem-llm 0.1.0 has one, except that a -random
    # variant draws it again at every reset (GuessTheNumber-v0-random: 4 to 8 turns), so it has no fixed one
    limit = None if env_id.endswith("-random") else getattr(game, "max_turns", None)
    json.dumps(kwargs)  # the options travel in every record: they must be plain values
    size, eval_size = int(opts.get("size", 1024)), int(opts.get("eval_size", 64))
    if size < 1 or eval_size < 1:
        raise ConfigError(f"task.gem.size={size}, task.gem.eval_size={eval_size}: both must be >= 1")
    return Task(
        name=NAME, parse_row=generated, template="{observation}", reward_spec="relign.envs.gem_env:episode_reward",
        chat=chat, system_prompt=system_prompt or None, env="relign.envs.gem_env:GemEnv",
        env_max_turns=limit if isinstance(limit, int) and limit > 0 else None,
        generate_spec="relign.envs.gem_env:generate",
        generate_kwargs={"env_id": env_id, "kwargs": kwargs, "success_reward": float(opts.get("success_reward", 1.0)),
                         "system_prompt": system_prompt or ""},
        generate_sizes=(size, eval_size), term_weights={}, step_delimiter=None,
    )


def episode_reward(prompt: str, response: str, extra_info: dict, **_: Any) -> dict:
    """Not used in training (the environment's rewards train); a single completion is one turn, so
    grading it means replaying that one action from the record's game."""
    g = extra_info["gem"]
    _, last = play(g["env_id"], g["kwargs"], int(g["seed"]), [response], offline=False)
    r = float(last[1]) if last else 0.0
    done = bool(last and (last[2] or last[3]))
    return {"reward": r, "score": float(done and r >= float(g.get("success_reward", 1.0)))}

