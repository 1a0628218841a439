/**
 * KV caches as blocks [rows, kvH, total, hd] (per layer, key and value), with each sequence
 * holding one row. Where its live positions sit depends on how the graph pads a batch:
 * left-padded graphs keep them right-aligned (columns total − length .. total − 1; anything left
 * of them is padding) and a block is a run's present outputs, replaced by the next run's;
 * right-padded graphs keep them left-aligned (columns 0 .. length − 1; what follows is masked
 * and must stay finite — blocks start zeroed and only ever receive computed columns) in a block
 * with room to grow (`blockCapacity`) that the runner writes each step's new columns into, in
 * place. A batch of one gives a block the sequence owns outright; a batched run
 * gives one block its sequences share, which is fed back as is when the same sequences step
 * together again (no copy) and repacked by block copies when they do not.
 */
import type { HostTensor } from './backend/types.ts'

export interface KvBlock {
  /** Per stage layer: [key, value], each [rows, kvH, total, hd]. */
  layers: Array<[HostTensor, HostTensor]>
  rows: number
  total: number
  /** The one buffer every tensor views, when the block was adopted from a run's output (`adoptColumns`). */
  owner?: ArrayBuffer
}

/** Where a sequence's cache lives: a row of a block (its last `length` columns, `length` kept on the sequence). */
export interface KvRef {
  block: KvBlock
  row: number
}

/**
 * Copies the last `length` columns of row `srcRow` of src [·, kvH, srcTotal, hd] to the last
 * `length` columns of row `dstRow` of dst [·, kvH, dstTotal, hd], zeroing dst's columns left of
 * them (padding must be finite: masked probabilities are 0, and 0 × NaN is not).
 */
export function copyRow (src: Float32Array, srcRow: number, srcTotal: number, dst: Float32Array, dstRow: number, dstTotal: number, length: number, kvH: number, hd: number): void {
  const n = length * hd
  for (let h = 0; h < kvH; h++) {
    const s = ((srcRow * kvH + h) * srcTotal + srcTotal - length) * hd
    const d0 = (dstRow * kvH + h) * dstTotal * hd
    const d = d0 + (dstTotal - length) * hd
    if (d > d0) dst.fill(0, d0, d)
    if (n > 0) dst.set(src.subarray(s, s + n), d)
  }
}

/**
 * Copies the first `length` columns of row `srcRow` of src [·, kvH, srcTotal, hd] to the first
 * `length` columns of row `dstRow` of dst [·, kvH, dstTotal, hd] (left-aligned caches). Columns
 * after them are left as they are: a right-padded graph counts nothing past a row's length (they
 * stay finite, which a one-position step needs: it masks them to exact zeros).
 */
export function copyRowLeft (src: Float32Array, srcRow: number, srcTotal: number, dst: Float32Array, dstRow: number, dstTotal: number, length: number, kvH: number, hd: number): void {
  const n = length * hd
  if (n === 0) return
  for (let h = 0; h < kvH; h++) {
    const s = (srcRow * kvH + h) * srcTotal * hd
    dst.set(src.subarray(s, s + n), (dstRow * kvH + h) * dstTotal * hd)
  }
}

/**
 * A left-aligned sequence's cache as [1, kvH, block.total, hd] views of its block row: a row of a
 * block is contiguous, so this never copies.
 */
export function rowView (ref: KvRef, layer: number, kvH: number, hd: number): [HostTensor, HostTensor] {
  const pair = ref.block.layers[layer]!
  if (ref.block.rows === 1) return pair
  const size = kvH * ref.block.total * hd
  const one = (t: HostTensor): HostTensor =>
    ({ type: 'float32', data: (t.data as Float32Array).subarray(ref.row * size, (ref.row + 1) * size), dims: [1, kvH, ref.block.total, hd] })
  return [one(pair[0]), one(pair[1])]
}

/** A sequence's cache as its own [1, kvH, length, hd] tensors (no copy when it owns a whole block). */
export function ownRow (ref: KvRef, length: number, layer: number, kvH: number, hd: number): [HostTensor, HostTensor] {
  const pair = ref.block.layers[layer]!
  if (ref.block.rows === 1 && ref.block.total === length) return pair
  const one = (t: HostTensor): HostTensor => {
    const data = new Float32Array(kvH * length * hd)
    copyRow(t.data as Float32Array, ref.row, ref.block.total, data, 0, length, length, kvH, hd)
    return { type: 'float32', data, dims: [1, kvH, length, hd] }
  }
  return [one(pair[0]), one(pair[1])]
}

/**
 * The first `keep` of a row's `length` live positions as a block of its own (speculative decoding's
 * rollback of rejected positions). Live columns are right-aligned, so dropping the newest ones
 * cannot be a view; it is one copy of what stays, the size of what the next step's concatenation
 * copies anyway.
 */
export function truncateRow (ref: KvRef, length: number, keep: number, kvH: number, hd: number): KvBlock {
  const { block, row } = ref
  const one = (t: HostTensor): HostTensor => {
    const src = t.data as Float32Array
    const data = new Float32Array(kvH * keep * hd)
    for (let h = 0; h < kvH; h++) {
      const s = ((row * kvH + h) * block.total + block.total - length) * hd
      data.set(src.subarray(s, s + keep * hd), h * keep * hd)
    }
    return { type: 'float32', data, dims: [1, kvH, keep, hd] }
  }
  return { rows: 1, total: keep, layers: block.layers.map(([k, v]) => [one(k), one(v)]) }
}

/**
 * Columns to give a left-aligned block that must hold `need` positions (at most `limit`, the
 * context). onnxruntime's GroupQueryAttention spends time on every column of the past it is fed,
 * live or not (60m int4, batch 8: ~6 µs a step per spare column), while outgrowing a block copies
 * every live column once; room ≈ 2·√need balances the two (about 28 columns at 192 positions,
 * 90 at 2,048), and never less than 16.
 */
export function blockCapacity (need: number, limit: number): number {
  return alignColumns(Math.min(limit, need + Math.max(16, Math.ceil(2 * Math.sqrt(need)))))
}

/**
 * Columns for a batch's shared block where one-position steps attend over live columns only
 * (BackendSession.liveColumnsOnly): half as many again as it must hold, at most 256 more. Why:
 * spare columns then cost memory alone, while outgrowing the block copies every row's columns
 * into a new one with every stream waiting — a 250m fp32 block of eight rows moving past 224
 * columns took 60–100 ms, and blockCapacity's room (for a past that is read whole) outgrew it
 * three or four times in a round of 128 tokens after 128-token prompts; with this room, once
 * (docs/engine-notes.md, wave 40), and with `reach`, the most positions any of its rows may
 * reach, not at all.
 */
export function groupCapacity (need: number, limit: number, reach = 0): number {
  const roomy = blockCapacity(need + Math.min(256, Math.ceil(need / 2)), limit)
  // Room to the positions the rows may reach (their prompts and max_tokens: StepRequest.reach),
  // so that a round of requests never outgrows its block (each growth a 48–101 ms stall on 250m
  // fp32, once a round of 128-token prompts and 128 tokens: engine-notes, wave 42). Never more
  // than twice what the block must hold and 256 columns: a request without max_tokens reaches the
  // context, and those columns would be memory held for a length it may never write. Never less
  // than the room it has without a reach: the reach is a hint, and a row may step past it.
  return Math.max(roomy, alignColumns(Math.min(limit, reach, 2 * need + 256)))
}

/**
 * Blocks are a multiple of 16 columns wide: the one-position attention's products (shards/graph/
 * attention.ts, decodeAttention) run on MLAS kernels that take columns four at a time and the last
 * one to three otherwise, and split work between threads at multiples of 16, so a live column's
 * bits depend on the buffer's width unless every width is such a multiple (docs/engine-notes.md,
 * wave 12). At most 15 masked columns more; a context limit that is not a multiple of 16 is
 * rounded up too (the columns past it stay masked; GroupQueryAttention takes such a past: a
 * 100-position model prefilled in chunks and decoded to its last position).
 */
export function alignColumns (columns: number): number {
  return Math.ceil(columns / 16) * 16
}

/**
 * A new left-aligned block of `capacity` columns with one row per source: row b holds the first
 * `length` columns of source b's row (nothing for an absent source); `rows` (at least one per
 * source) leaves rows to spare for sequences that join later (kv-rows.ts). Columns past a row's
 * length stay zero until the row's steps write them.
 */
export function packRows (sources: ReadonlyArray<{ ref: KvRef | undefined, length: number }>, capacity: number, layerCount: number, kvH: number, hd: number, rows = sources.length): KvBlock {
  if (rows < sources.length) throw new RangeError(`a block of ${rows} rows cannot hold ${sources.length} sources`)
  const tensor = (): HostTensor => ({ type: 'float32', data: new Float32Array(rows * kvH * capacity * hd), dims: [rows, kvH, capacity, hd] })
  const block: KvBlock = { rows, total: capacity, layers: Array.from({ length: layerCount }, () => [tensor(), tensor()]) }
  sources.forEach(({ ref, length }, b) => { if (ref !== undefined) copyRowInto(block, b, ref, length, kvH, hd) })
  return block
}

/**
 * Copies the first `length` columns of a sequence's row (`from`, in any block) into row `row` of
 * `block`, every layer's key and value: a sequence moving to another row (kv-rows.ts). Rows of
 * one block never overlap, so `from` may be another row of the same block.
 */
export function copyRowInto (block: KvBlock, row: number, from: KvRef, length: number, kvH: number, hd: number): void {
  block.layers.forEach((pair, i) => {
    pair.forEach((t, kind) => copyRowLeft(from.block.layers[i]![kind]!.data as Float32Array, from.row, from.block.total, t.data as Float32Array, row, block.total, length, kvH, hd))
  })
}

/** The block's first `n` rows as [n, kvH, total, hd] views per layer (no copy): a batched run's past. */
export function firstRows (block: KvBlock, n: number, kvH: number, hd: number): Array<[HostTensor, HostTensor]> {
  if (n === block.rows) return block.layers
  const size = n * kvH * block.total * hd
  const view = (t: HostTensor): HostTensor => ({ type: 'float32', data: (t.data as Float32Array).subarray(0, size), dims: [n, kvH, block.total, hd] })
  return block.layers.map(([k, v]) => [view(k), view(v)])
}

/**
 * Writes `count` columns of row `srcRow` of src [·, kvH, srcTotal, hd], starting at column
 * `srcAt`, into row `dstRow` of dst [·, kvH, dstTotal, hd] at column `dstAt` (a step's new
 * positions into a left-aligned block, in place).
 */
export function writeColumns (src: Float32Array, srcRow: number, srcTotal: number, srcAt: number, dst: Float32Array, dstRow: number, dstTotal: number, dstAt: number, count: number, kvH: number, hd: number): void {
  const n = count * hd
  for (let h = 0; h < kvH; h++) {
    const s = ((srcRow * kvH + h) * srcTotal + srcAt) * hd
    dst.set(src.subarray(s, s + n), ((dstRow * kvH + h) * dstTotal + dstAt) * hd)
  }
}

/** Grow-only scratch buffers for packed past KV, reused across runs (views are handed to the backend). */
export function createScratch (): (slot: number, length: number) => Float32Array {
  const buffers: Float32Array[] = []
  return (slot, length) => {
    let b = buffers[slot]
    if (b === undefined || b.length < length) {
      b = new Float32Array(Math.ceil(length * 1.25))
      buffers[slot] = b
    }
    return b.subarray(0, length)
  }
}

/**
 * A one-row block made of views of a run's `new_key_values` output [1, 2·n·kvH, s, hd], whose
 * layer i key is its (2i)th group of kvH heads and the value the next — [kvH, s, hd] each,
 * contiguous: a new sequence's first columns without allocating or copying a block. It is exactly
 * `s` columns wide, so the sequence's next step moves it to a block with room (kv-block
 * `blockCapacity`: one copy, as writing it into such a block now would have been), after this
 * step's token has been posted. Why: a 128-token prefill's new block (allocated zeroed) and its
 * columns copied in took ~0.5–0.7 ms between the run's end and the token (60m int4;
 * docs/engine-notes.md, wave 16), and a max_tokens-1 request never needs them moved at all.
 */
export function adoptColumns (data: Float32Array, layerCount: number, s: number, kvH: number, hd: number): KvBlock {
  const size = kvH * s * hd
  const view = (j: number): HostTensor => ({ type: 'float32', data: data.subarray(j * size, (j + 1) * size), dims: [1, kvH, s, hd] })
  const owner = wholeBuffer(data)
  return {
    rows: 1,
    total: s,
    layers: Array.from({ length: layerCount }, (_, i) => [view(2 * i), view(2 * i + 1)] as [HostTensor, HostTensor]),
    ...(owner === undefined ? {} : { owner }),
  }
}

/** The ArrayBuffer `a` spans whole (one that can be detached for it alone), or undefined. */
function wholeBuffer (a: Float32Array | BigInt64Array): ArrayBuffer | undefined {
  return a.buffer instanceof ArrayBuffer && a.byteOffset === 0 && a.byteLength === a.buffer.byteLength ? a.buffer : undefined
}

/**
 * Gives a block's memory back now instead of at some later garbage collection: each tensor that
 * owns its whole ArrayBuffer has it detached (`transfer(0)` frees the backing store), or an
 * adopted block's one buffer. V8 sees
 * onnxruntime's outputs as small objects, so a 2,000-token prefill left ~300 MB of replaced caches
 * (each chunk's present is the whole cache so far) waiting for a GC that did not come soon; the
 * process kept that high-water mark. Only for blocks nothing reads any more: no sequence or kept
 * prefix refers to it and no run that was fed it is still in flight (the runner checks both).
 */
export function freeBlock (block: KvBlock): void {
  const owned = block.owner !== undefined ? [block.owner] : block.layers.flatMap(pair => pair.map(t => wholeBuffer(t.data)))
  for (const buf of owned) if (buf !== undefined && !buf.detached) buf.transfer(0)
}

export function blockBytes (block: KvBlock): number {
  let n = 0
  for (const [k, v] of block.layers) n += k.data.byteLength + v.data.byteLength
  return n
}
