/**
 * Which rows of a shared KV block a batch of one-position steps runs on, as pure decisions
 * (in-place caches; runner-in-place.ts carries them out).
 *
 * A batched run is fed a block's first n rows as its past, row b being the run's row b. When the
 * batch's members change — a stream joins after its prefill, one ends, one skips a step — the
 * block need not be rebuilt: the rows that must move are moved, one row copy each, and the rest
 * stay where they are. Before, any change of membership packed every row into a new block (every
 * member's every column copied into a new block, allocated zeroed): three served eight-stream
 * rounds of 60m fp32 repacked 55 times (3 % of the worker's time), and on 250m fp32 a repack
 * stalled every stream 7–87 ms; with rows moved, 15 repacks and 35 row moves (docs/engine-notes.md,
 * wave 40). Rows are independent in every op of a step (each output element is the same chain of
 * multiply-adds whatever row it sits in), so a row's bits do not depend on where it sits: the
 * batched tests compare logits with each sequence's alone.
 */

/** A block's rows as a group of sequences about to step together finds them. */
export interface RowsNow {
  /** Rows the block has room for (its allocation). */
  capacity: number
  /** Per group entry: its row in the block, or undefined when its cache is in another block (or none yet). */
  members: ReadonlyArray<number | undefined>
  /** Rows of the block held by live sequences outside the group; `movable` when no step of theirs is running. */
  others: ReadonlyArray<{ row: number, movable: boolean }>
}

export interface RowPlan {
  /** The group entry at each of the block's first n rows: the run's rows, in order. */
  order: number[]
  /**
   * Other sequences' rows moved out of the first n rows, first of all: into a row nobody holds, or
   * (`to` undefined) when there is none, out of the block into one of the sequence's own.
   */
  evict: Array<{ from: number, to: number | undefined }>
  /** Group entries then copied into their run row (from another block, or from a row past the first n). */
  bring: Array<{ entry: number, to: number }>
}

/**
 * How to make the block's first n rows exactly the group's (n = members.length), moving as few
 * rows as it can: members already in the first n rows stay; another sequence's row there moves to
 * a row nobody holds, else to a block of its own (one copy either way, and its next step with the
 * group brings it back); members from further down or from other blocks fill the rows left.
 * Undefined when it cannot be done in this block (more members than rows, no member in it at all,
 * or another sequence in the way with a step running): the caller packs a new block then.
 */
export function planRows (now: RowsNow): RowPlan | undefined {
  const { capacity, members, others } = now
  const n = members.length
  if (n === 0 || n > capacity || members.every(r => r === undefined)) return undefined
  const held = new Set<number>()
  for (const r of members) if (r !== undefined) held.add(r)
  for (const o of others) held.add(o.row)
  // Rows past the first n that nobody holds: where others in the way go.
  const spare: number[] = []
  for (let r = n; r < capacity; r++) if (!held.has(r)) spare.push(r)
  const evict: RowPlan['evict'] = []
  for (const o of others) {
    if (o.row >= n) continue
    if (!o.movable) return undefined
    evict.push({ from: o.row, to: spare.shift() })
  }
  const order: Array<number | undefined> = new Array(n).fill(undefined)
  members.forEach((r, entry) => { if (r !== undefined && r < n) order[r] = entry })
  const bring: RowPlan['bring'] = []
  let free = 0
  members.forEach((r, entry) => {
    if (r !== undefined && r < n) return
    while (order[free] !== undefined) free++
    order[free] = entry
    bring.push({ entry, to: free })
  })
  return { order: order as number[], evict, bring }
}

/**
 * Rows to give a new block for a group of n: room for half as many again, and for every sequence
 * the runner has open (`open`: a burst's others, still prefilling, join next), at most `max` (the
 * runner's sequence bound). So streams joining one at a time find a free row: a burst of eight
 * joining one by one packs once (half as many again alone: three times, each a copy of every row
 * and a zeroed block, ~1 % of a 250m fp32 round; wave 42). The price is memory: a block is
 * allocated zeroed, so rows for sequences that have not joined yet.
 */
export function rowCapacity (n: number, max: number, open = n): number {
  return Math.max(n, Math.min(max, Math.max(n + Math.ceil(n / 2), open)))
}
