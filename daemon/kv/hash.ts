/**
 * Token-block hashes chained from the start of a sequence: block i's hash covers the scope and
 * every token of blocks 0..i, so equal hashes mean equal prefixes (up to sha256 collisions, which
 * the cache still guards against by comparing tokens). The scope seeds the chain, so the KV of one
 * model, stage layer range or dtype never answers for another's.
 */
import { createHash } from 'node:crypto'

/** Tokens per hashed block: small enough that most of a prefix is reusable, large enough to keep indexes short. */
export const DEFAULT_BLOCK_SIZE = 16

/** What makes two caches' KV interchangeable: the same weights, the same layers, the same KV dtype. */
export interface PrefixScopeInit {
  /** sha256 of the shard manifest (names the exact weights and graph). */
  manifestHash: string
  /** Inclusive global layer range of the stage holding the KV. */
  layers: readonly [number, number]
  /** Element type of the KV tensors, e.g. 'float32'. */
  dtype: string
}

/** Hex digits of a block hash in a node's summary (64 bits: collisions between a node's few hundred blocks are negligible, and a false match only costs a routing preference). */
export const SUMMARY_HASH_HEX = 16

/** A block hash as it appears in a summary. */
export function compactHash (hash: string): string {
  return hash.slice(0, SUMMARY_HASH_HEX)
}

/** A scope as one string (used as the hash chain's seed and as a plain key). */
export function prefixScope (s: PrefixScopeInit): string {
  return `kv1/${s.manifestHash}/${s.layers[0]}-${s.layers[1]}/${s.dtype}`
}

/**
 * Chained hashes (hex sha256) of the first `blocks` full blocks of `tokens` (default: every full
 * block; a trailing partial block has no hash).
 */
export function blockHashes (scope: string, tokens: ArrayLike<number>, blockSize = DEFAULT_BLOCK_SIZE, blocks = Math.floor(tokens.length / blockSize)): string[] {
  if (!Number.isSafeInteger(blockSize) || blockSize < 1) throw new RangeError(`block size must be a positive integer, not ${blockSize}`)
  const n = Math.min(blocks, Math.floor(tokens.length / blockSize))
  const out: string[] = []
  let prev = createHash('sha256').update(scope).digest()
  const buf = Buffer.alloc(blockSize * 4)
  for (let b = 0; b < n; b++) {
    for (let i = 0; i < blockSize; i++) buf.writeUInt32LE(tokens[b * blockSize + i]! >>> 0, i * 4)
    prev = createHash('sha256').update(prev).update(buf).digest()
    out.push(prev.toString('hex'))
  }
  return out
}

/**
 * The chained hashes that name exactly `tokens` (every one of them): blockHashes' full blocks,
 * then, when the length is not a multiple of the block size, one more link over the trailing
 * partial block. Two nodes agree on these only when they agree on the scope and on every token,
 * which is what a prefix moved between them must prove (/shoal/kv header).
 */
export function exactPrefixHashes (scope: string, tokens: ArrayLike<number>, blockSize = DEFAULT_BLOCK_SIZE): Buffer[] {
  if (!Number.isSafeInteger(blockSize) || blockSize < 1) throw new RangeError(`block size must be a positive integer, not ${blockSize}`)
  const out: Buffer[] = []
  let prev = createHash('sha256').update(scope).digest()
  for (let at = 0; at < tokens.length; at += blockSize) {
    const n = Math.min(blockSize, tokens.length - at)
    const buf = Buffer.alloc(n * 4)
    for (let i = 0; i < n; i++) buf.writeUInt32LE(tokens[at + i]! >>> 0, i * 4)
    prev = createHash('sha256').update(prev).update(buf).digest()
    out.push(prev)
  }
  return out
}
