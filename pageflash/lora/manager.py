"""Which adapters the engine knows (host memory) and which sit in the device's slots.

``AdapterCache``: adapters read from disk (lora/adapter.py), keyed by lora_int_id, the least
recently used dropped beyond ``capacity`` (vLLM's max_cpu_loras). A request holds its adapter
object, and one dropped from the cache while requests still hold it is handed out again rather than
read again: an adapter is read once however many requests wait under it, and host memory holds at
most one copy of it (dropping one no request holds costs a new read later). Each distinct adapter gets a ``uid`` that
names its weights: device slots and prefix-cache hashes are keyed by it, so an adapter removed and
added again (perhaps changed on disk) never meets the old one's slot or cached blocks.

``AdapterSlots``: the scheduler's view of the device's max_loras slots (slot 0 = no adapter). A
running request holds a reference to its adapter's slot; a waiting request gets a slot when it is
admitted -- its adapter's if loaded, else an empty one, else the least recently released slot no
running request uses -- and waits when every slot is held.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Optional

from pageflash.config import ModelConfig
from pageflash.lora.adapter import LoRAAdapter, load_adapter
from pageflash.lora.request import LoRARequest

__all__ = ["AdapterCache", "AdapterSlots"]


class AdapterCache:
    def __init__(self, model_cfg: ModelConfig, max_rank: int, capacity: int) -> None:
        self.model_cfg = model_cfg
        self.max_rank = max_rank
        self.capacity = capacity
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # int id -> adapter, least recent first
        self.known: dict[int, tuple[str, str, int]] = {}  # int id -> (name, path, uid), until removed
        # int id -> the adapter while anything (a request) holds it, cached or not
        self.held: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        self._next_uid = 1

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of req, read from its folder unless cached. ValueError for a bad folder, and
        for an int id already used by an adapter of another name or path."""
        if not isinstance(req, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        known = self.known.get(req.lora_int_id)
        if known is not None and known[:2] != (req.lora_name, req.lora_path):
            raise ValueError(f"lora_int_id {req.lora_int_id} is already used by adapter {known[0]!r} ({known[1]}); "
                             f"each adapter needs its own id (or remove that one first)")
        adapter = self.loaded.get(req.lora_int_id) or self.held.get(req.lora_int_id)
        if adapter is None:
            adapter = load_adapter(req, self.model_cfg, self.max_rank)
            if known is None:
                known = self.known[req.lora_int_id] = (req.lora_name, req.lora_path, self._next_uid)
                self._next_uid += 1
            adapter.uid = known[2]
            self.held[req.lora_int_id] = adapter
        self.loaded[req.lora_int_id] = adapter
        self.loaded.move_to_end(req.lora_int_id)
        while len(self.loaded) > self.capacity:
            self.loaded.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (a later request reads it again, as a new one). False if unknown."""
        self.loaded.pop(lora_int_id, None)
        self.held.pop(lora_int_id, None)  # (requests holding it finish under it; the id is new hereafter)
        return self.known.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        return set(self.known)


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.num_slots = max_loras + 1
        self.uid: list[Optional[int]] = [None] * self.num_slots  # slot -> uid of the adapter in it
        self.refs = [0] * self.num_slots  # running requests using each slot
        self.slot_of: dict[int, int] = {}  # uid -> slot
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded slots no request uses, least recent first

    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        return adapter.uid in self.slot_of or self._free_slot() is not None or bool(self.idle)

    def acquire(self, adapter: LoRAAdapter) -> tuple[int, bool]:
        """(slot, whether the adapter must be copied into it). Call can_acquire first."""
        slot = self.slot_of.get(adapter.uid)
        load = slot is None
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                if not self.idle:
                    raise RuntimeError("no LoRA slot is free (can_acquire was not checked)")
                slot, _ = self.idle.popitem(last=False)
                del self.slot_of[self.uid[slot]]
            self.uid[slot] = adapter.uid
            self.slot_of[adapter.uid] = slot
        self.idle.pop(slot, None)
        self.refs[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        """One running request fewer on slot; at zero the adapter stays loaded, evictable."""
        if slot == 0:
            return
        assert self.refs[slot] > 0, f"LoRA slot {slot} released more often than acquired"
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.idle[slot] = None

    def forget(self, uid: int) -> None:
        """An adapter removed from the engine: its slot, if no request uses it, becomes empty."""
        slot = self.slot_of.get(uid)
        if slot is not None and self.refs[slot] == 0:
            del self.slot_of[uid]
            self.uid[slot] = None
            self.idle.pop(slot, None)

    def _free_slot(self) -> Optional[int]:
        return next((s for s in range(1, self.num_slots) if self.uid[s] is None), None)

    @property
    def loaded(self) -> dict[int, int]:
        """uid -> slot of the adapters on the device."""
        return dict(self.slot_of)
