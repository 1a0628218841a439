/**
 * The prefix cache's index: which finished sequences' KV a node keeps, found by chained block
 * hashes (hash.ts), bounded by a byte budget with least-recently-used eviction. It holds no
 * tensors: the engine keeps each entry's KV under the entry's key, and the caller carries out
 * what this index decides (free the keys it returns). An entry leased to a request that is
 * prefilling from it is never evicted.
 */
import { blockHashes, DEFAULT_BLOCK_SIZE } from './hash.ts'
import { summaryHashes } from './summary.ts'
import { decideReuse, DEFAULT_MIN_PREFILL_TOKENS } from './decide.ts'

export interface PrefixCacheInit {
  /** Bytes of KV the kept entries may hold together. */
  budgetBytes: number
  blockSize?: number
  /** Default: one block. */
  minReuseTokens?: number
  /** Prompt positions always prefilled (decide.ts DEFAULT_MIN_PREFILL_TOKENS). */
  minPrefillTokens?: number
}

/** A longest cached prefix of a query. */
export interface PrefixMatch {
  key: string
  /** Tokens of the query the entry holds (may end inside a block). */
  length: number
  /** The entry's own length. */
  entryLength: number
}

/** A pinned entry: it stays until released. */
export interface PrefixLease {
  key: string
  /** Tokens to reuse (≤ prompt length − minPrefillTokens). */
  length: number
  release (): void
}

export interface InsertResult {
  /** Whether the new entry is kept (else its KV must be freed). */
  kept: boolean
  /**
   * Keys whose KV the caller must free now: evicted and superseded entries, and the new key
   * itself when it is not kept.
   */
  drop: string[]
}

export interface PrefixCacheStats {
  entries: number
  bytes: number
  budgetBytes: number
  pinned: number
  /** Prompt tokens served from the cache, and prompt tokens prefilled (by `acquire`). */
  hitTokens: number
  missTokens: number
  /** Entries removed to stay within the budget (not those superseded by a longer entry). */
  evictions: number
}

export interface PrefixCache {
  readonly blockSize: number
  /** The longest kept prefix of `tokens` within `maxTokens` (query only: no pin, no LRU touch). */
  lookup (scope: string, tokens: ArrayLike<number>, maxTokens?: number): PrefixMatch | undefined
  /**
   * For a new prompt: the decision (decideReuse) and, when it reuses, a lease on the entry. Counts
   * hit and miss tokens.
   */
  acquire (scope: string, promptIds: ArrayLike<number>): PrefixLease | undefined
  /**
   * Offers a finished sequence's KV (`tokens` are the positions it holds, `bytes` their size).
   * Superseded entries (prefixes of it) go; least recently used ones go until it fits; if it
   * cannot fit without evicting a leased entry, or adds nothing (it is a prefix of a kept entry),
   * it is not kept.
   */
  insert (scope: string, key: string, tokens: ArrayLike<number>, bytes: number): InsertResult
  /** Forgets an entry now (e.g. its KV was lost); a holder of a lease keeps what it already took. */
  remove (key: string): void
  stats (): PrefixCacheStats
  /** Keys of kept entries, least recently used first. */
  keys (): string[]
  /**
   * What this node holds, compact and bounded (for routing): up to `max` block hashes (compact,
   * see SUMMARY_HASH_HEX), most recently used entries first; from each entry its deepest block
   * and blocks 1, 2, 4, 8… deep (deepest first). A prompt sharing any prefix of an entry then
   * matches a listed block at least half as deep as what it shares.
   */
  summary (scope: string, max: number): string[]
}

interface Entry {
  key: string
  scope: string
  tokens: Int32Array
  hashes: string[]
  bytes: number
  pins: number
  removed: boolean
}

export function createPrefixCache (init: PrefixCacheInit): PrefixCache {
  const blockSize = init.blockSize ?? DEFAULT_BLOCK_SIZE
  const minReuse = init.minReuseTokens ?? blockSize
  const minPrefill = Math.max(1, init.minPrefillTokens ?? DEFAULT_MIN_PREFILL_TOKENS)
  const budget = init.budgetBytes
  /** Insertion order is recency order: a touched entry is deleted and set again. */
  const entries = new Map<string, Entry>()
  const byHash = new Map<string, Set<string>>()
  let bytes = 0
  let hitTokens = 0
  let missTokens = 0
  let evictions = 0

  const touch = (e: Entry): void => { entries.delete(e.key); entries.set(e.key, e) }

  function unlink (e: Entry): void {
    if (e.removed) return
    e.removed = true
    entries.delete(e.key)
    bytes -= e.bytes
    for (const h of e.hashes) {
      const set = byHash.get(h)
      set?.delete(e.key)
      if (set?.size === 0) byHash.delete(h)
    }
  }

  /** Tokens `a` and `b` share from the start, from `from` (assumed equal before it) up to `limit`. */
  function common (a: ArrayLike<number>, b: ArrayLike<number>, from: number, limit: number): number {
    let i = from
    while (i < limit && a[i] === b[i]) i++
    return i
  }

  function match (scope: string, tokens: ArrayLike<number>, maxTokens: number): PrefixMatch | undefined {
    const limit = Math.min(tokens.length, maxTokens)
    const hashes = blockHashes(scope, tokens, blockSize, Math.floor(limit / blockSize))
    for (let b = hashes.length - 1; b >= 0; b--) {
      const keys = byHash.get(hashes[b]!)
      if (keys === undefined) continue
      let best: PrefixMatch | undefined
      for (const key of keys) {
        const e = entries.get(key)!
        const full = (b + 1) * blockSize
        // The hashes say the first `full` tokens match; the tokens confirm it and extend the match.
        if (common(e.tokens, tokens, 0, full) < full) continue
        const length = common(e.tokens, tokens, full, Math.min(limit, e.tokens.length))
        if (best === undefined || length > best.length) best = { key, length, entryLength: e.tokens.length }
      }
      if (best !== undefined) return best
    }
    return undefined
  }

  return {
    blockSize,
    lookup (scope, tokens, maxTokens = tokens.length) {
      return match(scope, tokens, maxTokens)
    },
    acquire (scope, promptIds) {
      const n = promptIds.length
      const m = n > minPrefill ? match(scope, promptIds, n - minPrefill) : undefined
      const length = decideReuse({ promptLength: n, matchLength: m?.length ?? 0, minReuseTokens: minReuse, minPrefillTokens: minPrefill })
      if (m === undefined || length === 0) { missTokens += n; return undefined }
      hitTokens += length
      missTokens += n - length
      const e = entries.get(m.key)!
      e.pins++
      touch(e)
      let released = false
      return {
        key: m.key,
        length,
        release () {
          if (released) return
          released = true
          e.pins--
        },
      }
    },
    insert (scope, key, tokens, size) {
      const drop: string[] = []
      const refuse = (): InsertResult => ({ kept: false, drop: [...drop, key] })
      if (entries.has(key)) throw new Error(`prefix cache already holds ${key}`)
      if (tokens.length < blockSize || size > budget) return refuse()
      for (const e of entries.values()) {
        if (e.scope !== scope) continue
        const shared = common(e.tokens, tokens, 0, Math.min(e.tokens.length, tokens.length))
        // Adds nothing: an entry already holds all of it.
        if (shared === tokens.length) { touch(e); return refuse() }
        // A prefix of the new one, not leased: the new entry answers every lookup it would.
        if (shared === e.tokens.length && e.pins === 0) { unlink(e); drop.push(e.key) }
      }
      const victims: Entry[] = []
      let free = budget - bytes
      for (const e of entries.values()) {
        if (free >= size) break
        if (e.pins > 0) continue
        victims.push(e)
        free += e.bytes
      }
      if (free < size) return refuse()
      for (const e of victims) { unlink(e); drop.push(e.key); evictions++ }
      const copy = Int32Array.from(tokens)
      const e: Entry = { key, scope, tokens: copy, hashes: blockHashes(scope, copy, blockSize), bytes: size, pins: 0, removed: false }
      entries.set(key, e)
      bytes += size
      for (const h of e.hashes) {
        let set = byHash.get(h)
        if (set === undefined) { set = new Set(); byHash.set(h, set) }
        set.add(key)
      }
      return { kept: true, drop }
    },
    remove (key) {
      const e = entries.get(key)
      if (e !== undefined) unlink(e)
    },
    stats () {
      let pinned = 0
      for (const e of entries.values()) if (e.pins > 0) pinned++
      return { entries: entries.size, bytes, budgetBytes: budget, pinned, hitTokens, missTokens, evictions }
    },
    keys () {
      return [...entries.keys()]
    },
    summary (scope, max) {
      return summaryHashes([...entries.values()].reverse().filter(e => e.scope === scope).map(e => e.hashes), max)
    },
  }
}
