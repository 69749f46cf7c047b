"""The hottest cached prefixes as a tree, rebuilt from the block-key chain.

Every keyed block knows its parent's key, so the keyed blocks form a forest: a root is a prompt's first
block (or a block whose parent was evicted), and prompts that share a prefix share a path. Runs of blocks
with a single child are merged into one segment, so a 40-block system prompt is one node, not 40. A node
reports its first block's hits -- every hit on a later block of the path went through it -- and the
requests holding it (those holding a later block hold this one too: block tables are prefixes).

The tree is cut to the hottest roots and children and a node budget, and walked without recursion over
blocks, so a very long prompt costs no stack.
"""

from __future__ import annotations

MAX_ROOTS = 8
MAX_CHILDREN = 6
MAX_NODES = 80
MAX_LISTED_REQUESTS = 8


def build_prefix_tree(
    blocks: list[dict], max_roots: int = MAX_ROOTS, max_children: int = MAX_CHILDREN, max_nodes: int = MAX_NODES
) -> dict:
    """``blocks``: the KV map's entries (``id``, ``key``, ``parent``, ``hits``, ``ref_count``, ``requests``).

    Returns ``{"roots": [node, ...], "more_roots": n}``, a node being ``{"key", "block_ids", "blocks",
    "hits", "requests", "num_requests", "subtree_blocks", "children", "more_children"}``, hottest first.
    """
    by_key = {b["key"]: b for b in blocks if b["key"] is not None}
    children: dict[str, list[str]] = {}
    roots: list[str] = []
    for key, block in by_key.items():
        if block["parent"] in by_key:  # by_key holds no None: a block without a parent is a root
            children.setdefault(block["parent"], []).append(key)
        else:
            roots.append(key)
    size = _subtree_sizes(roots, children)

    def heat(key: str) -> tuple[int, int]:
        return by_key[key]["hits"], size[key]

    budget = [max_nodes]

    def node(key: str) -> dict:
        budget[0] -= 1
        first = by_key[key]
        block_ids = [first["id"]]
        while len(children.get(key, ())) == 1:  # follow a run of single children: one segment
            key = children[key][0]
            block_ids.append(by_key[key]["id"])
        holders = first["requests"]
        return {
            "key": first["key"],
            "block_ids": block_ids,
            "blocks": len(block_ids),
            "hits": first["hits"],
            "requests": holders[:MAX_LISTED_REQUESTS],
            "num_requests": first["ref_count"],  # each holder takes one reference (the list may be cut)
            "subtree_blocks": size[first["key"]],
            "children": [],
            "more_children": 0,
            "_last": key,
        }

    top = sorted(roots, key=heat, reverse=True)
    tree = [node(k) for k in top[:max_roots]]
    queue = list(tree)
    while queue:  # breadth first, so the budget goes to the upper levels
        current = queue.pop(0)
        kids = sorted(children.get(current.pop("_last"), ()), key=heat, reverse=True)
        shown = kids[: min(max_children, max(budget[0], 0))]
        current["children"] = [node(k) for k in shown]
        current["more_children"] = len(kids) - len(shown)
        queue.extend(current["children"])
    return {"roots": tree, "more_roots": max(0, len(roots) - max_roots)}


def _subtree_sizes(roots: list[str], children: dict[str, list[str]]) -> dict[str, int]:
    """Blocks under each key, itself included (iteratively: chains can be thousands of blocks long)."""
    order: list[str] = []
    stack = list(roots)
    while stack:
        key = stack.pop()
        order.append(key)
        stack.extend(children.get(key, ()))
    size: dict[str, int] = {}
    for key in reversed(order):
        size[key] = 1 + sum(size[c] for c in children.get(key, ()))
    return size
