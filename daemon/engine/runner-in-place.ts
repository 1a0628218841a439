/**
 * The dynamic runner's left-aligned caches, for graphs with `batchPadding: 'right'`
 * (GroupQueryAttention with per-row lengths): a row's live positions are its block's first
 * columns, the attention_mask is ones for them and the new positions, zeros after, and the graph
 * attends over each row's own length — so any mix of lengths shares a run bit-exactly. A sequence
 * takes its row of a shared block as a view (rows are contiguous), never a copy.
 *
 * The caches are kept in place: a sequence's block has room to grow, the graph counts each row's
 * first `length` columns of it (a one-position step of a compiler-6 graph reads the whole buffer
 * in place and masks the rest, which is why blocks start zeroed: it must be finite; a row a
 * sequence left keeps its finite columns), and each step's new columns are written into the row
 * after the run (from the graph's `new_key_values` outputs: onnxruntime-node copies every fetched
 * output, and a present would be the whole cache). A rollback is a shorter length. When a batch's
 * members change, only the rows that must move are copied (kv-rows.ts); a block is copied whole
 * only when it runs out of room (kv-block.ts `blockCapacity`) or rows, or to move a sequence off a
 * kept prefix's block, which is never written. A new sequence's first chunk allocates nothing: its
 * block is that run's new_key_values as they came (kv-block.ts `adoptColumns`), exactly as wide
 * as its columns, so its next step moves it to a block with room — after the token went out.
 */
import { GREEDY_TOKEN, HIDDEN_OUT, LOGITS, NEW_KV, newKeyName, newValueName, pastKeyName, pastValueName, presentKeyName, presentValueName } from '../../shards/contract.ts'
import { EngineError } from './errors.ts'
import { stepMark } from '../step-trace.ts'
import type { TensorMap } from './backend/types.ts'
import { adoptColumns, blockCapacity, copyRowInto, firstRows, groupCapacity, packRows, rowView, writeColumns } from './kv-block.ts'
import type { KvBlock, KvRef } from './kv-block.ts'
import { planRows, rowCapacity } from './kv-rows.ts'
import { chunkFeeds, groupFeeds, groupOutputs } from './runner-io.ts'
import { isGreedy } from './sampling.ts'
import type { KvLayout, KvSequence, Live, RunContext } from './runner-io.ts'
import type { BatchStepResult } from './runner-sequences.ts'

export interface InPlaceDeps {
  /** Whether a block is a kept prefix's (runner-prefixes.ts): never written. */
  isKept: (block: KvBlock) => boolean
  /** Frees a replaced block unless something still refers to it. */
  release: (block: KvBlock | undefined) => void
  /** The live sequences whose cache is a row of `block`. */
  holders: (block: KvBlock) => KvSequence[]
  /** How many sequences the runner has open (kv-rows.ts rowCapacity: rows for those that join next). */
  open: () => number
}

export function createInPlaceLayout (ctx: RunContext, deps: InPlaceDeps): KvLayout {
  const { session, stage, layers, kvH, hd } = ctx
  const { isKept, release, holders, open } = deps
  // Graphs that output a step's new columns alone (compiler ≥ 5) are fetched without their
  // presents: onnxruntime-node copies every fetched output, and a present is the whole cache, every step.
  const newOutputs = layers.every(l => session.outputNames.includes(newKeyName(l)) && session.outputNames.includes(newValueName(l)))
  // Compiler ≥ 8 also gives them as one output: one fetch instead of two a layer (~6 µs each).
  const packed = newOutputs && session.outputNames.includes(NEW_KV)
  const main = stage.hasHead ? LOGITS : HIDDEN_OUT
  const fetches = packed ? [main, NEW_KV] : newOutputs ? [main, ...layers.flatMap(l => [newKeyName(l), newValueName(l)])] : undefined
  // Compiler ≥ 10: a step whose rows are all greedy fetches their tokens instead of the logits.
  const greedyFetches = packed && stage.hasHead && session.outputNames.includes(GREEDY_TOKEN) ? [GREEDY_TOKEN, NEW_KV] : fetches

  /**
   * A run's new_key_values [rows, 2·n·kvH, s, hd]: row b's layer i key is its (2i)th group of kvH
   * heads, the value the next — as a [rows·2n, kvH, s, hd] tensor, the source row b·2n + 2i + kind.
   */
  function packedNew (out: TensorMap, rows: number, s: number): Float32Array {
    const t = out[NEW_KV]
    const n = layers.length
    if (t?.type !== 'float32' || t.dims[0] !== rows || t.dims[1] !== 2 * n * kvH || t.dims[2] !== s || t.dims[3] !== hd) throw new EngineError(`stage graph returned no float32 ${NEW_KV} of [${rows}, ${2 * n * kvH}, ${s}, ${hd}]`)
    return t.data
  }

  /**
   * Writes a run's new KV columns into the rows' blocks, in place: row b of the run gets `s`
   * columns at its sequence's length (from new_key_values, or from present's same columns for
   * graphs without them).
   */
  function writeNew (out: TensorMap, targets: ReadonlyArray<{ ref: KvRef, at: number } | undefined>, s: number): void {
    if (packed) {
      const data = packedNew(out, targets.length, s)
      const n = layers.length
      targets.forEach((target, b) => {
        if (target === undefined) return
        const { ref, at } = target
        for (let i = 0; i < n; i++) {
          for (let kind = 0; kind < 2; kind++) writeColumns(data, b * 2 * n + 2 * i + kind, s, 0, ref.block.layers[i]![kind]!.data as Float32Array, ref.row, ref.block.total, at, s, kvH, hd)
        }
      })
      return
    }
    layers.forEach((l, i) => {
      const names = newOutputs ? [newKeyName(l), newValueName(l)] : [presentKeyName(l), presentValueName(l)]
      names.forEach((name, kind) => {
        const t = out[name]
        if (t?.type !== 'float32' || t.dims[0] !== targets.length || t.dims[1] !== kvH || t.dims[3] !== hd) throw new EngineError(`stage graph returned no float32 ${name} of [${targets.length}, ${kvH}, ·, ${hd}]`)
        const srcTotal = t.dims[2]!
        targets.forEach((target, b) => {
          if (target === undefined) return
          const { ref, at } = target
          writeColumns(t.data, b, srcTotal, newOutputs ? 0 : at, ref.block.layers[i]![kind]!.data as Float32Array, ref.row, ref.block.total, at, s, kvH, hd)
        })
      })
    })
  }

  /**
   * The session for a run of `s` positions over a past buffer `width` columns wide: the
   * one-position graph exactly where the stage graph's one-position Ifs would take their
   * then-branch (their condition: S = 1 and a non-empty past; shards/graph/attention.ts).
   */
  const sessionFor = (s: number, width: number): typeof session => s === 1 && width > 0 ? ctx.decodeSession ?? session : session
  /** A batch runs one-position steps on a session whose attention reads live columns only: its block may have more room (packGroup). */
  const roomyGroups = sessionFor(1, 1).liveColumnsOnly === true

  /** Whether a sequence may write `need` columns into its block as it is (its own row, room, not a kept prefix). */
  const writable = (ref: KvRef, need: number): boolean => ref.block.total >= need && !isKept(ref.block)

  /** Moves a sequence to a block of its own with room for `need` columns (one copy of its live ones). */
  function moveToRoom (seq: KvSequence, need: number): void {
    const old = seq.kv
    seq.kv = { block: packRows([{ ref: old, length: seq.length }], blockCapacity(need, stage.maxPositions), layers.length, kvH, hd), row: 0 }
    release(old?.block)
  }

  return {
    /**
     * Its block row is fed whole as the past (the graph reads only the row's first `length`
     * columns: attention_mask is ones for the live positions and the new ones, and no wider), and
     * the chunk's new columns are written into the row after the run. Rolled-back columns are simply
     * overwritten; nothing is copied unless the row must move to a block with more room (or off a
     * kept prefix, which stays as it is).
     */
    async runChunk (seq, input, a, b, positions, keep, greedy) {
      const s = b - a
      const total = seq.length + s
      if (seq.kv !== undefined && !writable(seq.kv, total)) moveToRoom(seq, total)
      const mask = new BigInt64Array(total).fill(1n)
      const feeds = chunkFeeds(ctx, input, a, b, positions, mask, keep, i => seq.kv === undefined ? undefined : rowView(seq.kv, i, kvH, hd))
      const out = await sessionFor(s, seq.kv?.block.total ?? 0).run(feeds, greedy ? greedyFetches : fetches)
      if (seq.kv === undefined) {
        // Dropped while it ran (drop lets go of the KV first): nothing to keep.
        if (seq.dropped !== undefined) return out
        // A new sequence's first columns: the run's new_key_values as they came (kv-block.ts
        // adoptColumns), moved to a block with room by its next step, after this token is out.
        if (packed && seq.length === 0) {
          seq.kv = { block: adoptColumns(packedNew(out, 1, s), layers.length, s, kvH, hd), row: 0 }
          seq.length = total
          return out
        }
        seq.kv = { block: packRows([{ ref: undefined, length: 0 }], blockCapacity(total, stage.maxPositions), layers.length, kvH, hd), row: 0 }
      }
      // Written even when the sequence was retained meanwhile: retain keeps what whole chunks left.
      writeNew(out, [{ ref: seq.kv, at: seq.length }], s)
      seq.length = total
      return out
    },

    /**
     * The rows run in the block most of them already share, with only the rows that must move
     * moved (kv-rows.ts planRows: a joiner copied into a free row, a leaver's row refilled, another
     * sequence's row in the way set aside); else, when no such block has room for all of them and
     * their columns, packed into a new block with room and spare rows (one copy of every live
     * column). Each row attends over its own length, and its new columns are written into its row
     * after the run. The rows run in block order; results come back in the group's.
     */
    async runGroup (group: Live[], s: number): Promise<BatchStepResult[]> {
      let lmax = 0
      for (const { seq } of group) lmax = Math.max(lmax, seq.length)
      const total = lmax + s
      const ordered = placeRows(group, total) ?? packGroup(group, total)
      const block = ordered[0]!.seq.kv!.block
      const rows = ordered.length
      const mask = new BigInt64Array(rows * total)
      ordered.forEach(({ seq }, b) => mask.fill(1n, b * total, b * total + seq.length + s))
      const feeds = groupFeeds(ctx, ordered, s, mask, total)
      firstRows(block, rows, kvH, hd).forEach(([k, v], i) => {
        feeds[pastKeyName(layers[i]!)] = k
        feeds[pastValueName(layers[i]!)] = v
      })
      const out = await sessionFor(s, block.total).run(feeds, ordered.every(({ item }) => isGreedy(item.pick)) ? greedyFetches : fetches)
      // A row dropped meanwhile (drop lets go of its KV first) is skipped; the others are written.
      writeNew(out, ordered.map(({ seq }) => seq.kv === undefined ? undefined : { ref: seq.kv, at: seq.length }), s)
      const results = groupOutputs(stage, ordered, s, out, () => {})
      return group.map(e => results[ordered.indexOf(e)]!)
    },
  }

  /**
   * The group in the rows of the block most of its members hold (of the shared blocks it may
   * write, `need` columns wide), moved there as planRows says; undefined when there is no such
   * block or planRows finds no way.
   */
  function placeRows (group: Live[], need: number): Live[] | undefined {
    const counts = new Map<KvBlock, number>()
    for (const { seq } of group) {
      const b = seq.kv?.block
      if (b !== undefined && b.rows >= 2 && b.rows >= group.length && writable({ block: b, row: 0 }, need)) counts.set(b, (counts.get(b) ?? 0) + 1)
    }
    let block: KvBlock | undefined
    for (const [b, c] of counts) if (block === undefined || c > counts.get(block)!) block = b
    if (block === undefined) return undefined
    const inGroup = new Set(group.map(({ seq }) => seq))
    const others = holders(block).filter(seq => !inGroup.has(seq))
    const plan = planRows({
      capacity: block.rows,
      members: group.map(({ seq }) => seq.kv?.block === block ? seq.kv.row : undefined),
      others: others.map(seq => ({ row: seq.kv!.row, movable: seq.running === undefined })),
    })
    if (plan === undefined) return undefined
    if (plan.evict.length + plan.bring.length > 0) stepMark('k.rows') // rows moved (SHOAL_TRACE_DIR traces)
    // Looked up before anything moves: a sequence moved out takes row 0 of a block of its own.
    const atRow = new Map(others.map(seq => [seq.kv!.row, seq]))
    for (const { from, to } of plan.evict) {
      const seq = atRow.get(from)!
      if (to === undefined) { moveToRoom(seq, seq.length + 1); continue }
      copyRowInto(block, to, seq.kv!, seq.length, kvH, hd)
      seq.kv = { block, row: to }
    }
    const replaced = new Set<KvBlock>()
    for (const { entry, to } of plan.bring) {
      const { seq } = group[entry]!
      if (seq.kv !== undefined) {
        copyRowInto(block, to, seq.kv, seq.length, kvH, hd)
        if (seq.kv.block !== block) replaced.add(seq.kv.block)
      }
      seq.kv = { block, row: to }
    }
    for (const old of replaced) release(old)
    return plan.order.map(entry => group[entry]!)
  }

  /**
   * The group packed in its own order into a new block with room for `need` columns (more where
   * spare columns cost a one-position step nothing: kv-block.ts groupCapacity, up to what its rows
   * may reach) and spare rows.
   */
  function packGroup (group: Live[], need: number): Live[] {
    stepMark('k.pack') // a repack (SHOAL_TRACE_DIR traces): how engine-notes, wave 8, timed them
    // The rows' reach, when every row has one (a row without one may need any room).
    let reach = 0
    for (const { seq } of group) {
      if (seq.reach === undefined) { reach = 0; break }
      reach = Math.max(reach, seq.reach)
    }
    const columns = roomyGroups ? groupCapacity(need, stage.maxPositions, reach) : blockCapacity(need, stage.maxPositions)
    const block = packRows(group.map(({ seq }) => ({ ref: seq.kv, length: seq.length })), columns, layers.length, kvH, hd, rowCapacity(group.length, ctx.maxSequences, open()))
    const replaced = new Set<KvBlock>()
    group.forEach(({ seq }, b) => {
      if (seq.kv !== undefined) replaced.add(seq.kv.block)
      seq.kv = { block, row: b }
    })
    for (const old of replaced) release(old)
    return group
  }
}
