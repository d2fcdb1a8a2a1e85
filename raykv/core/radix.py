"""Block radix tree: a trie of committed blocks keyed by block digest, one root per scope.

Each block's key already commits to its whole prefix (keys chain), so the tree stores one node per
block: ``parent`` links upward, ``children`` maps child key -> Block. Every block's parent is in the
tree (a block is only removed while it has no children), so every block in the tree is matchable.
The tree holds no pages' bytes; ``Block.page`` is the Page backing the block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from raykv.core import page as page_module
from raykv.core.errors import StateError
from raykv.core.page import Page, bind_compiled
from raykv.core.types import BlockKey


class Root:
    """The root of one scope: ``key`` is the scope's root key."""

    __slots__ = ("children", "key")

    def __init__(self, key: BlockKey) -> None:
        self.key = key
        self.children: dict[BlockKey, Block] = {}


class Block:
    """One committed block. ``ordinal`` is its index in the sequence (0 for a root's child).
    ``checksum``: its page's CRC-32 once a sender computed it (None before); a committed block's
    bytes never change, so it holds while the block is in the tree (re-committing a key makes a
    new Block, without one)."""

    __slots__ = ("checksum", "children", "key", "num_tokens", "ordinal", "page", "parent")

    def __init__(self, key: BlockKey, parent: Root | Block, page: Page, num_tokens: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockKey, Block] = {}
        self.page = page
        self.ordinal: int = parent.ordinal + 1 if isinstance(parent, Block) else 0
        self.num_tokens = num_tokens
        self.checksum: int | None = None

    @property
    def parent_key(self) -> BlockKey:
        return self.parent.key

    @property
    def is_leaf(self) -> bool:
        return not self.children


class BlockRadixTree:
    """All committed blocks of one manager."""

    def __init__(self) -> None:
        self.roots: dict[BlockKey, Root] = {}
        self.blocks: dict[BlockKey, Block] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def get(self, key: BlockKey) -> Block | None:
        return self.blocks.get(key)

    def parent_node(self, parent_key: BlockKey, create_root: bool) -> Root | Block | None:
        """The block or root with this key; a missing root is created when ``create_root``."""
        node: Root | Block | None = self.blocks.get(parent_key) or self.roots.get(parent_key)
        if node is None and create_root:
            node = Root(parent_key)
            self.roots[parent_key] = node
        return node

    def insert(self, parent: Root | Block, key: BlockKey, page: Page, num_tokens: int) -> Block:
        """Add a block under ``parent`` (a node of this tree) backed by ``page``.

        Raises StateError if the key is already in the tree or the page already backs a block.
        """
        if key in self.blocks:
            raise StateError(f"block {key.hex()[:16]} is already in the tree")
        if page.block is not None:
            raise StateError("page already backs a block")
        if isinstance(parent, Root) and parent.key not in self.roots:
            self.roots[parent.key] = parent
        block = Block(key, parent, page, num_tokens)
        parent.children[key] = block
        self.blocks[key] = block
        page.block = block
        return block

    def insert_chain(
        self, parent: Root | Block, keys: Sequence[BlockKey], pages: Sequence[Page], tokens: Sequence[int]
    ) -> None:
        """:meth:`insert` ``keys[0]`` under ``parent``, each later key under the one before it,
        backed by ``pages`` (same order). Raises StateError, with nothing changed, if a key is
        already in the tree (or twice in ``keys``), a page already backs a block, or the
        sequences differ in length."""
        blocks = self.blocks
        if not len(keys) == len(pages) == len(tokens):
            raise StateError("a chain needs one page and one token count per key")
        if len(set(keys)) != len(keys) or not blocks.keys().isdisjoint(keys):
            raise StateError("a chain key is already in the tree")
        fast = page_module.compiled_chain
        if fast is not None and all(type(x) in (list, tuple) for x in (keys, pages, tokens)):
            ordinal = parent.ordinal + 1 if isinstance(parent, Block) else 0
            made = fast.link_chain(parent, keys, pages, tokens, ordinal)  # checks the pages
            if made is None:
                raise StateError("page already backs a block")
        else:
            if any(page.block is not None for page in pages):
                raise StateError("page already backs a block")
            node, made = parent, []
            for key, page, num_tokens in zip(keys, pages, tokens):
                block = Block(key, node, page, num_tokens)
                node.children[key] = block
                page.block = block
                made.append(block)
                node = block
        if isinstance(parent, Root) and parent.key not in self.roots:
            self.roots[parent.key] = parent
        blocks.update(zip(keys, made))

    def remove(self, block: Block) -> None:
        """Remove a leaf block (and its root once the root has no children).

        Raises StateError for a block with children (they would lose their prefix).
        """
        if block.children:
            raise StateError(f"block {block.key.hex()[:16]} still has {len(block.children)} children")
        parent = block.parent
        del parent.children[block.key]
        del self.blocks[block.key]
        block.page.block = None
        if isinstance(parent, Root) and not parent.children:
            self.roots.pop(parent.key, None)

    def match(self, root_key: BlockKey, keys: Sequence[BlockKey]) -> list[Block]:
        """The longest run of ``keys`` that is a chain from this scope's root."""
        node: Root | Block | None = self.roots.get(root_key)
        out: list[Block] = []
        for key in keys:
            if node is None:
                break
            node = node.children.get(key)
            if node is None:
                break
            out.append(node)
        return out

    def match_keys(self, keys: Sequence[BlockKey]) -> list[Block]:
        """Longest run of ``keys`` present as a parent-child chain, starting at ``keys[0]``."""
        if not keys:
            return []
        first = self.blocks.get(keys[0])
        if first is None:
            return []
        out = [first]
        node = first
        for key in keys[1:]:
            child = node.children.get(key)
            if child is None:
                break
            out.append(child)
            node = child
        return out

    def iter_blocks(self) -> Iterator[Block]:
        return iter(self.blocks.values())

    def check(self) -> None:
        """Raise AssertionError if links, roots or the key index disagree."""
        seen = 0
        for root in self.roots.values():
            assert root.children, "empty root left in the tree"
            stack: list[Block] = list(root.children.values())
            while stack:
                block = stack.pop()
                seen += 1
                assert self.blocks.get(block.key) is block, "block missing from index"
                assert block.parent.children.get(block.key) is block, "broken parent link"
                assert block.page.block is block, "page does not point back to its block"
                for child in block.children.values():
                    assert child.parent is block, "child's parent link is wrong"
                    stack.append(child)
        assert seen == len(self.blocks), f"{len(self.blocks) - seen} blocks unreachable from roots"


bind_compiled(Block)  # raykv.native._chain, bound to Page and Block (page.compiled_chain None: Python)
