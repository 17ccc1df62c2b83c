"""Search trees (MCTS, step beam): a node list -> nested, foldable ``<details>``, the chosen path first."""

from __future__ import annotations

import html
from collections import deque
from dataclasses import dataclass
from typing import Any

from .util import _cut, _is_num, _text, fmt

MAX_TREE_NODES = 2000  # nodes per tree (the chosen path first, then breadth-first)
MAX_TREE_DEPTH = 120  # nesting levels per tree
MAX_NODE_TEXT = 400  # characters of a node's step text


@dataclass
class Tree:
    nodes: dict[str, dict[str, Any]]  # id (as text) -> node
    children: dict[str, list[str]]
    roots: list[str]
    keep: set[str]  # the nodes shown
    total: int


def build_tree(raw: list[Any], cap: int | None = None, max_depth: int | None = None) -> Tree:
    """Index a tree's node list and choose the nodes to show: the chosen path (and its
    ancestors) first, then breadth-first from the roots, up to ``cap`` nodes and
    ``max_depth`` levels. A node whose parent is absent is a root; a cycle is never reached."""
    cap = MAX_TREE_NODES if cap is None else cap
    max_depth = MAX_TREE_DEPTH if max_depth is None else max_depth
    nodes: dict[str, dict[str, Any]] = {}
    for n in raw:
        if isinstance(n, dict) and n.get("id") is not None:
            nodes.setdefault(_text(n["id"]), n)
    parent = {k: (_text(n.get("parent")) if n.get("parent") is not None else None) for k, n in nodes.items()}
    children: dict[str, list[str]] = {k: [] for k in nodes}
    roots = []
    for k in nodes:
        p = parent[k]
        if p is None or p not in nodes or p == k:
            parent[k] = None
            roots.append(k)
        else:
            children[p].append(k)
    level: dict[str, int] = {}
    queue = deque((r, 0) for r in roots)
    order = []
    while queue:
        k, d = queue.popleft()
        if k in level:
            continue
        level[k] = d
        order.append(k)
        queue.extend((c, d + 1) for c in children[k])
    keep: set[str] = set()
    for k in order:  # the chosen path, with every ancestor so that it hangs together
        if _truthy(nodes[k].get("chosen")) and level[k] < max_depth and k not in keep:
            path, a = [], k
            while a is not None and a not in keep:
                path.append(a)
                a = parent[a]
            if len(keep) + len(path) <= cap:
                keep.update(path)
    for k in order:
        if len(keep) >= cap:
            break
        if level[k] < max_depth and (parent[k] is None or parent[k] in keep):
            keep.add(k)
    return Tree(nodes, children, roots, keep, len(nodes))


def render_tree(raw: list[Any], problem: Any) -> str:
    tree = build_tree(raw)
    any_chosen = any(_truthy(tree.nodes[k].get("chosen")) for k in tree.keep)
    parts: list[str] = []
    stack: list[tuple[str, str]] = [("open", r) for r in reversed([r for r in tree.roots if r in tree.keep])]
    while stack:
        op, k = stack.pop()
        if op == "close":
            parts.append("</ul></details></li>")
            continue
        node = tree.nodes[k]
        kids = [c for c in tree.children[k] if c in tree.keep]
        chosen, terminal = _truthy(node.get("chosen")), _truthy(node.get("terminal"))
        classes = "node" + (" chosen" if chosen else "") + (" terminal" if terminal else "") + ("" if kids else " leaf")
        attrs = (f'class="{classes}" data-node="{html.escape(k)}" data-parent="{html.escape(_text(node.get("parent")))}" '
                 f'data-visits="{html.escape(_text(node.get("visits")))}" data-q="{html.escape(_text(node.get("q")))}" '
                 f'data-chosen="{int(chosen)}"')
        line = _node_line(k, node, terminal)
        if kids:
            is_open = chosen or (not any_chosen and tree.nodes[k].get("parent") is None)
            parts.append(f'<li {attrs}><details{" open" if is_open else ""}><summary>{line}</summary><ul>')
            stack.append(("close", k))
            stack.extend(("open", c) for c in reversed(kids))
        else:
            parts.append(f'<li {attrs}><div class="nline">{line}</div></li>')
    shown = len(tree.keep)
    note = f"{tree.total} nodes" if shown == tree.total else (
        f"{shown} of {tree.total} nodes shown (the chosen path, then breadth-first up to {MAX_TREE_NODES} nodes"
        f" and {MAX_TREE_DEPTH} levels)")
    note += "; highlighted: the path to the chosen answer" if any_chosen else ""
    return (
        f'<div class="tree" data-problem="{html.escape(_text(problem))}" data-nodes="{tree.total}" data-shown="{shown}">'
        '<div class="tree-tools"><button type="button" data-act="expand">expand all</button>'
        '<button type="button" data-act="collapse">collapse all</button>'
        '<button type="button" data-act="chosen">chosen path</button>'
        f'<span class="note">{html.escape(note)} · N visits · Q mean value · P prior · V value · ■ terminal</span></div>'
        f'<ul class="tree-root">{"".join(parts)}</ul></div>'
    )


def _node_line(key: str, node: dict[str, Any], terminal: bool) -> str:
    text = _text(node.get("text")).strip("\n")
    empty = "(root)" if node.get("parent") is None else "(empty)"
    text_html = (f'<span class="ntext">{html.escape(_cut(text, MAX_NODE_TEXT))}</span>' if text.strip()
                 else f'<span class="ntext empty">{empty}</span>')
    stats = []
    for name, short in (("visits", "N"), ("q", "Q"), ("prior", "P"), ("value", "V")):
        v = node.get(name)
        if _is_num(v):
            stats.append(f"{short} {fmt(v)}")
    if _is_num(node.get("tokens")):
        stats.append(f"{fmt(node['tokens'])} tok")
    term = ""
    if terminal:
        answer = node.get("answer")
        shown = " " + html.escape(_cut(_text(answer), 100)) if answer is not None else ""
        term = f'<span class="nterm" title="terminal">■{shown}</span>'
    return (f'<span class="nid">#{html.escape(_cut(key, 40))}</span>{text_html}{term}'
            f'<span class="nstats">{html.escape(" · ".join(stats))}</span>')


def _truthy(v: Any) -> bool:
    return v is True or (_is_num(v) and v > 0)
