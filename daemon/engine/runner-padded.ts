/**
 * The dynamic runner's right-aligned caches, for left-padded graphs ('standard' op table): the
 * graph's `present.*` outputs (past + new, concatenated by the graph) become the next step's
 * `past_key_values.*`, so the cache is exactly the live context. Sequences stepping the same number
 * of new positions S share one run, their past caches left-padded to the longest (attention_mask
 * zeros), so no query row is wasted on padding; the present outputs stay one shared block
 * (kv-block.ts) that the next run of the same sequences takes as its past without a copy, and that
 * are repacked into reused scratch buffers when they do not step together again.
 */
import { presentKeyName, presentValueName, pastKeyName, pastValueName } from '../../shards/contract.ts'
import { EngineError } from './errors.ts'
import type { HostTensor, TensorMap } from './backend/types.ts'
import { copyRow, createScratch, ownRow } from './kv-block.ts'
import type { KvBlock } from './kv-block.ts'
import { chunkFeeds, emptyPast, groupBlock, groupFeeds, groupOutputs } from './runner-io.ts'
import type { KvLayout, Live, RunContext } from './runner-io.ts'
import type { BatchStepResult } from './runner-sequences.ts'

/** `release`: frees a replaced block unless something still refers to it (the runner's kept prefixes decide). */
export function createPaddedLayout (ctx: RunContext, release: (block: KvBlock | undefined) => void): KvLayout {
  const { session, layers, kvH, hd } = ctx
  const scratch = createScratch()

  /** Takes a run's present outputs as the new cache block of its `rows` sequences. */
  function presentBlock (out: TensorMap, rows: number, total: number): KvBlock {
    return {
      rows,
      total,
      layers: layers.map(l => {
        const k = out[presentKeyName(l)]
        const v = out[presentValueName(l)]
        if (k?.type !== 'float32' || v?.type !== 'float32') throw new EngineError(`stage graph returned no float32 present KV for layer ${l}`)
        if (k.dims[2] !== total || k.dims[0] !== rows) throw new EngineError(`present.${l}.key has shape [${k.dims.join(', ')}], expected [${rows}, ${kvH}, ${total}, ${hd}]`)
        return [k, v]
      }),
    }
  }

  return {
    async runChunk (seq, input, a, b, positions, keep) {
      const s = b - a
      const total = seq.length + s
      // Right-aligned caches are fed as exactly their live positions.
      const past = seq.kv === undefined ? 0 : seq.length
      const width = past + s
      const mask = new BigInt64Array(width)
      mask.fill(1n, 0, total)
      const feeds = chunkFeeds(ctx, input, a, b, positions, mask, keep, i => seq.kv === undefined ? undefined : ownRow(seq.kv, seq.length, i, kvH, hd))
      const out = await session.run(feeds)
      const old = seq.kv?.block
      seq.kv = { block: presentBlock(out, 1, width), row: 0 }
      seq.length = total
      release(old)
      return out
    },

    /**
     * Past caches left-padded to the longest (or the shared block itself when it is exactly these
     * sequences, in order), new positions aligned, padding masked. Entries dropped meanwhile get
     * errors.
     */
    async runGroup (group: Live[], s: number): Promise<BatchStepResult[]> {
      const rows = group.length
      // The previous run's block, fed as is, when it holds exactly these sequences in order.
      const { block: held, longest: pmax } = groupBlock(group)
      const shared = held !== undefined && held.total === pmax ? held : undefined
      const total = pmax + s
      const mask = new BigInt64Array(rows * total)
      group.forEach(({ seq }, b) => mask.fill(1n, b * total + pmax - seq.length, (b + 1) * total))
      const feeds = groupFeeds(ctx, group, s, mask, total)
      layers.forEach((l, i) => {
        let pair: [HostTensor, HostTensor]
        if (shared !== undefined) pair = shared.layers[i]!
        else if (pmax === 0) pair = [emptyPast(ctx, rows), emptyPast(ctx, rows)]
        else {
          pair = [0, 1].map(kind => {
            const data = scratch(2 * i + kind, rows * kvH * pmax * hd)
            group.forEach(({ seq }, b) => {
              const src = seq.kv === undefined ? undefined : seq.kv.block.layers[i]![kind]!
              if (src === undefined) copyRow(data, 0, 0, data, b, pmax, 0, kvH, hd) // zero row
              else copyRow(src.data as Float32Array, seq.kv!.row, seq.kv!.block.total, data, b, pmax, seq.length, kvH, hd)
            })
            return { type: 'float32', data, dims: [rows, kvH, pmax, hd] } satisfies HostTensor
          }) as [HostTensor, HostTensor]
        }
        feeds[pastKeyName(l)] = pair[0]
        feeds[pastValueName(l)] = pair[1]
      })
      const out = await session.run(feeds)
      const block = presentBlock(out, rows, total)
      const replaced = new Set<KvBlock>()
      for (const { seq } of group) if (seq.dropped === undefined && seq.kv !== undefined) replaced.add(seq.kv.block)
      const outs = groupOutputs(ctx.stage, group, s, out, (seq, b) => { seq.kv = { block, row: b } })
      for (const old of replaced) release(old)
      return outs
    },
  }
}
