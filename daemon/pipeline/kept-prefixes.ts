/**
 * A stage node's book of kept prefixes (prefix reuse on chains): which finished requests' KV its
 * engine keeps, under which key, for which coordinator, within a byte budget with
 * least-recently-used eviction. It holds no tensors (the engine keeps them under the same keys)
 * and decides only; the node carries out the evictions it returns. Each stage of a chain keeps its
 * own book, so stages evict independently: a coordinator that opens from a key a stage dropped
 * gets SHOAL_ERR_STAGE_PREFIX_GONE from it and prefills instead.
 */

export interface KeptPrefix {
  key: string
  /** The coordinator that asked for it: only it may open from it (its keys are its own). */
  owner: string
  /** Positions kept. */
  length: number
  bytes: number
}

export interface KeptPrefixesStats {
  entries: number
  bytes: number
  budgetBytes: number
  /** Entries dropped to stay within the budget. */
  evictions: number
}

export interface KeptPrefixes {
  /**
   * Records a prefix the engine now keeps; returns the keys to evict from the engine: least
   * recently used entries until it fits, or the new key itself when it alone exceeds the budget.
   */
  add (p: KeptPrefix): { kept: boolean, drop: string[] }
  /** Whether `owner` may open `length` positions of `key` now (touches it: most recently used). */
  take (key: string, owner: string, length: number): boolean
  has (key: string): boolean
  /** The entry under `key`, without touching it (a peer pulls a copy: that is not a use here). */
  get (key: string): KeptPrefix | undefined
  /** Forgets keys (the caller evicts them from the engine). */
  remove (keys: readonly string[]): void
  /** Forgets those of `keys` that `owner` kept; returns them (the caller evicts them from the engine). */
  removeOwned (keys: readonly string[], owner: string): string[]
  stats (): KeptPrefixesStats
}

export function createKeptPrefixes (budgetBytes: number): KeptPrefixes {
  /** Insertion order is recency order: a touched entry is deleted and set again. */
  const entries = new Map<string, KeptPrefix>()
  let bytes = 0
  let evictions = 0

  function forget (key: string): void {
    const e = entries.get(key)
    if (e === undefined) return
    entries.delete(key)
    bytes -= e.bytes
  }

  return {
    add (p) {
      if (entries.has(p.key)) forget(p.key)
      if (p.bytes > budgetBytes || p.length <= 0) return { kept: false, drop: [p.key] }
      const drop: string[] = []
      let free = budgetBytes - bytes
      for (const e of entries.values()) {
        if (free >= p.bytes) break
        drop.push(e.key)
        free += e.bytes
        evictions++
      }
      for (const k of drop) forget(k)
      entries.set(p.key, { ...p })
      bytes += p.bytes
      return { kept: true, drop }
    },
    take (key, owner, length) {
      const e = entries.get(key)
      if (e === undefined || e.owner !== owner || length < 1 || length > e.length) return false
      entries.delete(key)
      entries.set(key, e)
      return true
    },
    has: key => entries.has(key),
    get: key => { const e = entries.get(key); return e === undefined ? undefined : { ...e } },
    remove (keys) { for (const k of keys) forget(k) },
    removeOwned (keys, owner) {
      const mine = keys.filter(k => entries.get(k)?.owner === owner)
      for (const k of mine) forget(k)
      return mine
    },
    stats: () => ({ entries: entries.size, bytes, budgetBytes, evictions }),
  }
}
