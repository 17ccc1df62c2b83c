"""Inference-time search: cot, majority, best-of-N, weighted majority, step beam and MCTS.

Every strategy takes a list of problems and returns one ``SearchResult`` per problem, with
every engine call batched across the problems (lockstep) and every generated token counted
in a ``Cost``. See docs/search.md and ``relign.strategies.base`` for the shared types.
"""
