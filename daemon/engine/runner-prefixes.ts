/**
 * The dynamic runner's kept prefixes (left-aligned caches only): `retain` ends a sequence but keeps
 * the first columns of its cache under a key, compacted into a block of its own; `openFrom` starts
 * a new sequence from the first L columns of a kept prefix, so only the rest of its prompt runs. A
 * kept block is never written: a sequence opened from it shares it until its first step, which
 * moves it to a block with room (runner-in-place.ts). Which prefixes to keep is the caller's
 * decision (daemon/kv); this only holds the tensors. Because sequences and kept prefixes both refer
 * to blocks, this is also where a block that lost a reference is freed (`release`).
 */
import { EngineError } from './errors.ts'
import type { HostTensor } from './backend/types.ts'
import { blockBytes, copyRowLeft, freeBlock } from './kv-block.ts'
import type { KvBlock, KvRef } from './kv-block.ts'
import type { StageInfo } from './protocol.ts'
import type { KvSequence } from './runner-io.ts'

/** The runner's prefix methods, as StageRunner documents them (retain, openFrom, evict, exportPrefix, importPrefix). */
export interface PrefixOps {
  retain: (seqId: string, key: string, maxLength: number) => Promise<{ length: number, bytes: number }>
  openFrom: (seqId: string, key: string, length: number) => void
  evict: (keys: readonly string[]) => void
  exportPrefix: (key: string, length: number) => Float32Array[]
  importPrefix: (key: string, length: number, layers: readonly Float32Array[]) => { length: number, bytes: number }
}

export interface KeptPrefixesInit {
  /** The runner's open sequences (retain ends one; openFrom opens one). */
  sequences: Map<string, KvSequence>
  stage: Pick<StageInfo, 'maxPositions'>
  layerCount: number
  kvH: number
  hd: number
  /** Whether the runner's caches are left-aligned: only those keep prefixes. */
  leftAligned: boolean
  /** Throws when `seqId` may not be opened (already open, or the runner is full). */
  checkOpen: (seqId: string) => void
}

export interface KeptPrefixes {
  ops: PrefixOps
  /** Whether a block is a kept prefix's (never written). */
  isKept: (block: KvBlock) => boolean
  /**
   * Frees a block that lost a reference, unless a sequence or a kept prefix still refers to it.
   * Called only once no run fed with it can still be in flight: after the run that replaced it,
   * and after a dropped sequence's running step ended (a running step's sequence still refers to
   * the block it was fed until the step's result replaces it).
   */
  release: (block: KvBlock | undefined) => void
  /** The live sequences whose cache is a row of `block` (a batched run moves rows among them). */
  holders: (block: KvBlock) => KvSequence[]
  stats: () => { keptPrefixes: number, keptBytes: number }
}

export function createKeptPrefixes (init: KeptPrefixesInit): KeptPrefixes {
  const { sequences, stage, layerCount, kvH, hd, leftAligned, checkOpen } = init
  /** Kept prefixes by key: a one-row block of exactly the kept positions. */
  const kept = new Map<string, KvBlock>()

  function isKept (block: KvBlock): boolean {
    for (const k of kept.values()) if (k === block) return true
    return false
  }

  function holders (block: KvBlock): KvSequence[] {
    const found: KvSequence[] = []
    for (const s of sequences.values()) if (s.kv?.block === block) found.push(s)
    return found
  }

  function release (block: KvBlock | undefined): void {
    if (block === undefined) return
    for (const s of sequences.values()) if (s.kv?.block === block) return
    for (const k of kept.values()) if (k === block) return
    freeBlock(block)
  }

  /** The first `length` columns of a left-aligned row as a one-row block of its own (no copy when it already is one). */
  function compact (ref: KvRef, length: number): KvBlock {
    if (ref.block.rows === 1 && ref.block.total === length) return ref.block
    return {
      rows: 1,
      total: length,
      layers: ref.block.layers.map(pair => pair.map(t => {
        const data = new Float32Array(kvH * length * hd)
        copyRowLeft(t.data as Float32Array, ref.row, ref.block.total, data, 0, length, length, kvH, hd)
        return { type: 'float32', data, dims: [1, kvH, length, hd] } satisfies HostTensor
      }) as [HostTensor, HostTensor]),
    }
  }

  const ops: PrefixOps = {
    async retain (seqId, key, maxLength) {
      if (!leftAligned) throw new EngineError('only graphs with left-aligned caches (batchPadding "right") keep prefixes')
      if (kept.has(key)) throw new EngineError(`a prefix is already kept as ${key}`)
      const seq = sequences.get(seqId)
      if (seq === undefined) return { length: 0, bytes: 0 }
      // Like a free: a step still running stops at its next chunk boundary, and what it left
      // (whole chunks, with their length) is consistent.
      seq.dropped = 'free'
      sequences.delete(seqId)
      await seq.running
      const length = Math.min(seq.length, Math.max(0, Math.floor(maxLength)))
      const ref = seq.kv
      seq.kv = undefined
      if (ref === undefined || length === 0) { release(ref?.block); return { length: 0, bytes: 0 } }
      const block = compact(ref, length)
      kept.set(key, block)
      if (block !== ref.block) release(ref.block)
      return { length, bytes: blockBytes(block) }
    },
    openFrom (seqId, key, length) {
      checkOpen(seqId)
      const block = kept.get(key)
      if (block === undefined) throw new EngineError(`no prefix is kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > block.total) throw new EngineError(`prefix ${key} holds ${block.total} positions, not ${length}`)
      // The kept block is shared as is (its first `length` columns are the sequence's); a kept
      // block is never written, so the first step moves the sequence to a block with room.
      const kv: KvRef = { block, row: 0 }
      sequences.set(seqId, { kv, length, running: undefined, dropped: undefined })
    },
    evict (keys) {
      for (const k of keys) {
        const block = kept.get(k)
        kept.delete(k)
        release(block)
      }
    },
    exportPrefix (key, length) {
      const block = kept.get(key)
      if (block === undefined) throw new EngineError(`no prefix is kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > block.total) throw new EngineError(`prefix ${key} holds ${block.total} positions, not ${length}`)
      // Always a copy: the arrays leave the worker (transferred), and a kept block is shared.
      const out: Float32Array[] = []
      for (const pair of block.layers) {
        for (const t of pair) {
          const data = new Float32Array(kvH * length * hd)
          copyRowLeft(t.data as Float32Array, 0, block.total, data, 0, length, length, kvH, hd)
          out.push(data)
        }
      }
      return out
    },
    importPrefix (key, length, tensors) {
      if (!leftAligned) throw new EngineError('only graphs with left-aligned caches (batchPadding "right") keep prefixes')
      if (kept.has(key)) throw new EngineError(`a prefix is already kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > stage.maxPositions) throw new EngineError(`an imported prefix of ${length} positions does not fit a context of ${stage.maxPositions}`)
      if (tensors.length !== 2 * layerCount) throw new EngineError(`an imported prefix has ${tensors.length} tensors; this stage has ${layerCount} layers (key and value each)`)
      const size = kvH * length * hd
      tensors.forEach((t, i) => {
        if (t.length !== size) throw new EngineError(`imported tensor ${i} holds ${t.length} values, not [${kvH}, ${length}, ${hd}]`)
        // A checksum catches transport damage; a NaN or infinity would still poison every later
        // attention over this prefix, and no computed KV holds one.
        for (let j = 0; j < t.length; j++) if (!Number.isFinite(t[j]!)) throw new EngineError(`imported tensor ${i} holds a non-finite value`)
      })
      const block: KvBlock = {
        rows: 1,
        total: length,
        layers: Array.from({ length: layerCount }, (_, i) => [0, 1].map(kind => ({ type: 'float32', data: tensors[2 * i + kind]!, dims: [1, kvH, length, hd] } satisfies HostTensor)) as [HostTensor, HostTensor]),
      }
      kept.set(key, block)
      return { length, bytes: blockBytes(block) }
    },
  }

  return {
    ops,
    isKept,
    release,
    holders,
    stats () {
      let keptBytes = 0
      for (const k of kept.values()) keptBytes += blockBytes(k)
      return { keptPrefixes: kept.size, keptBytes }
    },
  }
}
