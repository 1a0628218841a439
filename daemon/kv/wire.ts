/**
 * The /shoal/kv/1.0.0 wire format: a node that lacks a conversation's prefix pulls its KV from a
 * peer that keeps it (KV mobility). One stream per pull: the puller sends one `pull` frame; the
 * holder answers `header`, then every tensor in `chunk` frames, then `end` — or one `error` frame.
 *
 * A frame is an unsigned-varint length, then a payload (integers little-endian, strings UTF-8):
 *   u8 version (1) | u8 kind | u8 n | n bytes request id | body | u32 crc32 of every byte before it
 * Bodies:
 *   pull    u8 n | manifest hash | u32 first layer | u32 last layer | u8 n | dtype | u32 block size
 *           | u32 max chunk bytes | u32 count | count × u32 token id
 *   header  u8 n | manifest hash | u32 first layer | u32 last layer | u8 n | dtype | u32 tokens
 *           | u32 kv heads | u32 head dim | u32 block size | u32 chunks | u32 hashes
 *           | hashes × 32 bytes: the chained sha256 of the scope and the tokens (exactPrefixHashes:
 *             every full block, then the partial last one), so the puller can check them against
 *             its own token ids in its own scope
 *   chunk   u32 seq (0, 1, … over the whole transfer) | u32 layer (global index) | u8 part (0 key,
 *           1 value) | u32 offset (values into the tensor) | u32 count | count × f32
 *           Tensors go in order — layer by layer, key before value, each [kv heads, tokens, head
 *           dim] row-major — each split into chunks of at most the puller's max chunk bytes.
 *   end     u32 chunks (the header's count, again)
 *   error   JSON {name, code, message}: the holder refuses (SHOAL_ERR_KV_NOT_HELD, _WRONG_MODEL,
 *           _REFUSED) or failed
 *   pull-kept (kind 6) the pull body, then u8 n | key | u8 n | owner: a chain stage's pull of what
 *           it kept under a coordinator's key (pipeline/stage-node.ts) — a stage sees activations,
 *           not token ids, so it cannot look its prefixes up by tokens; the key names the prefix,
 *           and the token ids (the coordinator gave them to the puller) still make the block hashes
 *           the puller checks. Added within version 1: every other frame is unchanged, and a holder
 *           without it rejects the unknown kind, so the puller recomputes.
 *
 * Why crc32 per frame and not sha256: the stream already runs inside Noise's authenticated
 * encryption, so nobody on the path can alter bytes unseen; and an admitted holder that lies
 * would hash its lies too, so a cryptographic digest would buy nothing against it. What is left
 * to catch is damage inside the two nodes — framing and copying bugs, memory faults — for which a
 * CRC is the textbook tool: it detects every error burst of up to 32 bits (so every single-byte
 * change) and runs at memory speed (node:zlib's crc32), where sha256 would cost about as much as
 * the copy itself on a fast link. What the KV stands for is proved separately by the chained
 * block hashes, which the puller recomputes from its own token ids.
 */
import { crc32 } from 'node:zlib'
import { Uint8ArrayList } from 'uint8arraylist'
import { deserializeError } from '../errors.ts'
import type { SerializedError } from '../errors.ts'
import { joinParts, lengthPrefixed } from '../wire-bytes.ts'
import { KvWireError } from './errors.ts'
import type { KvWireErrorCode } from './errors.ts'
import { exactPrefixHashes, prefixScope } from './hash.ts'

export const KV_PROTOCOL = '/shoal/kv/1.0.0'
export const KV_WIRE_VERSION = 1
/** Largest payload either side accepts: bounds what one frame can make a node buffer. */
export const MAX_FRAME_BYTES = 1024 * 1024
/** Tensor bytes per chunk a puller asks for by default (well inside the frame cap). */
export const DEFAULT_MAX_CHUNK_BYTES = 256 * 1024
/** A chunk may carry at most this many tensor bytes, whatever a puller asks: it must fit a frame. */
export const MAX_CHUNK_BYTES = MAX_FRAME_BYTES - 1024
export const HASH_BYTES = 32
const MAX_STRING_BYTES = 255
const MAX_ERROR_MESSAGE_CHARS = 2048

const KIND_CODES = { pull: 1, header: 2, chunk: 3, end: 4, error: 5, 'pull-kept': 6 } as const
export type KvFrameKind = keyof typeof KIND_CODES
const KIND_BY_CODE = new Map(Object.entries(KIND_CODES).map(([k, v]) => [v as number, k as KvFrameKind]))

/** What makes KV interchangeable (daemon/kv/hash.ts PrefixScopeInit), as the frames carry it. */
export interface KvScopeFields {
  manifestHash: string
  layers: readonly [number, number]
  dtype: string
}

export type KvFrame =
  | ({ kind: 'pull', requestId: string, blockSize: number, maxChunkBytes: number, tokens: readonly number[] } & KvScopeFields)
  /** A stage's pull of the prefix it kept under `key` for coordinator `owner` (at most tokens.length positions). */
  | ({ kind: 'pull-kept', requestId: string, blockSize: number, maxChunkBytes: number, tokens: readonly number[], key: string, owner: string } & KvScopeFields)
  | ({ kind: 'header', requestId: string, tokens: number, numKvHeads: number, headDim: number, blockSize: number, chunks: number, hashes: Uint8Array[] } & KvScopeFields)
  | { kind: 'chunk', requestId: string, seq: number, layer: number, part: 0 | 1, offset: number, data: Uint8Array }
  | { kind: 'end', requestId: string, chunks: number }
  | { kind: 'error', requestId: string, error: SerializedError }

if (new Uint8Array(Uint16Array.of(1).buffer)[0] !== 1) throw new Error('the kv wire format assumes a little-endian host')

const utf8 = new TextEncoder()
const utf8Strict = new TextDecoder('utf-8', { fatal: true })
const fail = (code: KvWireErrorCode, message: string, cause?: unknown): KvWireError =>
  new KvWireError(code, message, cause === undefined ? undefined : { cause })
const malformed = (message: string, cause?: unknown): KvWireError => fail('SHOAL_ERR_KV_MALFORMED', message, cause)
const isU32 = (n: unknown): n is number => Number.isInteger(n) && (n as number) >= 0 && (n as number) < 2 ** 32

/** Grows as fields are written; the body before any bulk tensor data. */
class Writer {
  private readonly bytes: number[] = []
  u8 (n: number): this { this.bytes.push(n & 0xff); return this }
  u32 (n: number, what: string): this {
    if (!isU32(n)) throw malformed(`${what} must be a u32, not ${n}`)
    this.bytes.push(n & 0xff, (n >>> 8) & 0xff, (n >>> 16) & 0xff, (n >>> 24) & 0xff)
    return this
  }

  str (s: string, what: string, minBytes = 1): this {
    const b = utf8.encode(s)
    if (b.length < minBytes || b.length > MAX_STRING_BYTES) throw malformed(`${what} must be ${minBytes}-${MAX_STRING_BYTES} bytes of UTF-8`)
    this.u8(b.length)
    for (const x of b) this.bytes.push(x)
    return this
  }

  raw (b: Uint8Array): this { for (const x of b) this.bytes.push(x); return this }
  done (): Uint8Array { return Uint8Array.from(this.bytes) }
}

function scopeFields (w: Writer, f: KvScopeFields): void {
  if (!isU32(f.layers[0]) || !isU32(f.layers[1]) || f.layers[0] > f.layers[1]) throw malformed(`layer range ${f.layers[0]}-${f.layers[1]} is not u32s in order`)
  w.str(f.manifestHash, 'manifest hash').u32(f.layers[0], 'first layer').u32(f.layers[1], 'last layer').str(f.dtype, 'dtype')
}

/** The payload as parts, crc32 trailer included; a chunk's tensor bytes are not copied. */
export function encodePayloadParts (f: KvFrame): Uint8Array[] {
  const w = new Writer().u8(KV_WIRE_VERSION).u8(KIND_CODES[f.kind]).str(f.requestId, 'request id')
  const parts: Uint8Array[] = []
  switch (f.kind) {
    case 'pull':
    case 'pull-kept':
      scopeFields(w, f)
      if (f.blockSize < 1) throw malformed('block size must be at least 1')
      w.u32(f.blockSize, 'block size').u32(f.maxChunkBytes, 'max chunk bytes').u32(f.tokens.length, 'token count')
      for (const t of f.tokens) w.u32(t, 'token id')
      if (f.kind === 'pull-kept') w.str(f.key, 'key').str(f.owner, 'owner')
      parts.push(w.done())
      break
    case 'header':
      scopeFields(w, f)
      if (f.blockSize < 1) throw malformed('block size must be at least 1')
      w.u32(f.tokens, 'tokens').u32(f.numKvHeads, 'kv heads').u32(f.headDim, 'head dim').u32(f.blockSize, 'block size').u32(f.chunks, 'chunks').u32(f.hashes.length, 'hash count')
      for (const h of f.hashes) {
        if (h.length !== HASH_BYTES) throw malformed(`a block hash must be ${HASH_BYTES} bytes`)
        w.raw(h)
      }
      parts.push(w.done())
      break
    case 'chunk':
      if (f.part !== 0 && f.part !== 1) throw malformed('chunk part must be 0 (key) or 1 (value)')
      if (f.data.length === 0 || f.data.length % 4 !== 0) throw malformed(`chunk data of ${f.data.length} bytes is not a positive number of f32 values`)
      w.u32(f.seq, 'seq').u32(f.layer, 'layer').u8(f.part).u32(f.offset, 'offset').u32(f.data.length / 4, 'count')
      parts.push(w.done(), f.data)
      break
    case 'end':
      parts.push(w.u32(f.chunks, 'chunks').done())
      break
    case 'error':
      parts.push(w.raw(utf8.encode(JSON.stringify({ name: f.error.name, code: f.error.code, message: f.error.message.slice(0, MAX_ERROR_MESSAGE_CHARS) }))).done())
      break
  }
  let crc = 0
  for (const p of parts) crc = crc32(p, crc)
  const trailer = new Uint8Array(4)
  new DataView(trailer.buffer).setUint32(0, crc, true)
  parts.push(trailer)
  return parts
}

/** The frame as it goes on the stream: varint length, then the payload parts. */
export function encodeFrameParts (f: KvFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array[] {
  return lengthPrefixed(encodePayloadParts(f), maxFrameBytes, len => fail('SHOAL_ERR_KV_TOO_LARGE', `${f.kind} frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`))
}

/** The frame as one contiguous byte array (tests, golden bytes). */
export function encodeFrame (f: KvFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array {
  return joinParts(encodeFrameParts(f, maxFrameBytes))
}

/** Reads fields off a payload's body; running past `end` is a truncation. */
class Reader {
  at: number
  private readonly dv: DataView
  private readonly buf: Uint8Array
  private readonly end: number
  private readonly what: string
  constructor (buf: Uint8Array, at: number, end: number, what: string) {
    this.buf = buf
    this.at = at
    this.end = end
    this.what = what
    this.dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength)
  }

  private need (n: number): void {
    if (this.at + n > this.end) throw fail('SHOAL_ERR_KV_TRUNCATED', `${this.what}: frame ends inside its body`)
  }

  u8 (): number { this.need(1); return this.buf[this.at++]! }
  u32 (): number { this.need(4); const v = this.dv.getUint32(this.at, true); this.at += 4; return v }
  bytes (n: number): Uint8Array { this.need(n); const b = this.buf.subarray(this.at, this.at + n); this.at += n; return b }
  str (what: string): string {
    const n = this.u8()
    if (n === 0) throw malformed(`${this.what}: ${what} is empty`)
    try {
      return utf8Strict.decode(this.bytes(n))
    } catch (err) {
      if ((err as { code?: unknown }).code === 'SHOAL_ERR_KV_TRUNCATED') throw err
      throw malformed(`${this.what}: ${what} is not valid UTF-8`, err)
    }
  }

  scope (): KvScopeFields {
    const manifestHash = this.str('manifest hash')
    const first = this.u32()
    const last = this.u32()
    if (first > last) throw malformed(`${this.what}: layer range ${first}-${last} is not in order`)
    return { manifestHash, layers: [first, last], dtype: this.str('dtype') }
  }

  /** Nothing may follow the body but the crc. */
  finish (): void {
    if (this.at !== this.end) throw malformed(`${this.what}: ${this.end - this.at} bytes after the body`)
  }
}

/**
 * Decodes one payload (the bytes inside a length prefix): version, then checksum, then structure.
 * Every failure is a KvWireError with a stable code. Chunk data is a view into `buf`.
 */
export function decodePayload (buf: Uint8Array): KvFrame {
  if (buf.length < 1) throw fail('SHOAL_ERR_KV_TRUNCATED', 'empty frame')
  if (buf[0] !== KV_WIRE_VERSION) throw fail('SHOAL_ERR_KV_UNSUPPORTED_VERSION', `kv frame version ${buf[0]} is not supported (this node speaks ${KV_WIRE_VERSION})`)
  if (buf.length < 7) throw fail('SHOAL_ERR_KV_TRUNCATED', `frame of ${buf.length} bytes is shorter than its header and checksum`)
  const end = buf.length - 4
  const want = new DataView(buf.buffer, buf.byteOffset, buf.byteLength).getUint32(end, true)
  if (crc32(buf.subarray(0, end)) !== want) throw fail('SHOAL_ERR_KV_CHECKSUM', 'frame checksum (crc32) does not match its bytes')
  const kind = KIND_BY_CODE.get(buf[1]!)
  if (kind === undefined) throw fail('SHOAL_ERR_KV_UNKNOWN_KIND', `unknown kv frame kind ${buf[1]}`)
  const r = new Reader(buf, 2, end, kind)
  const requestId = r.str('request id')
  switch (kind) {
    case 'pull':
    case 'pull-kept': {
      const scope = r.scope()
      const blockSize = r.u32()
      const maxChunkBytes = r.u32()
      const n = r.u32()
      if (blockSize < 1) throw malformed(`${kind}: block size must be at least 1`)
      if (r.at + 4 * n > end) throw fail('SHOAL_ERR_KV_TRUNCATED', `${kind}: ${n} token ids do not fit the frame`)
      const tokens: number[] = new Array(n)
      for (let i = 0; i < n; i++) tokens[i] = r.u32()
      if (kind === 'pull') {
        r.finish()
        return { kind, requestId, ...scope, blockSize, maxChunkBytes, tokens }
      }
      const key = r.str('key')
      const owner = r.str('owner')
      r.finish()
      return { kind, requestId, ...scope, blockSize, maxChunkBytes, tokens, key, owner }
    }
    case 'header': {
      const scope = r.scope()
      const tokens = r.u32()
      const numKvHeads = r.u32()
      const headDim = r.u32()
      const blockSize = r.u32()
      const chunks = r.u32()
      const n = r.u32()
      if (blockSize < 1) throw malformed('header: block size must be at least 1')
      if (r.at + HASH_BYTES * n > end) throw fail('SHOAL_ERR_KV_TRUNCATED', `header: ${n} block hashes do not fit the frame`)
      const hashes: Uint8Array[] = []
      for (let i = 0; i < n; i++) hashes.push(r.bytes(HASH_BYTES))
      r.finish()
      return { kind, requestId, ...scope, tokens, numKvHeads, headDim, blockSize, chunks, hashes }
    }
    case 'chunk': {
      const seq = r.u32()
      const layer = r.u32()
      const part = r.u8()
      const offset = r.u32()
      const count = r.u32()
      if (part !== 0 && part !== 1) throw malformed(`chunk: part ${part} is neither key (0) nor value (1)`)
      if (count === 0) throw malformed('chunk: no values')
      if (r.at + 4 * count > end) throw fail('SHOAL_ERR_KV_TRUNCATED', `chunk: ${count} values do not fit the frame`)
      const data = r.bytes(4 * count)
      r.finish()
      return { kind, requestId, seq, layer, part, offset, data }
    }
    case 'end': {
      const chunks = r.u32()
      r.finish()
      return { kind, requestId, chunks }
    }
    case 'error': {
      let v: unknown
      try {
        v = JSON.parse(utf8Strict.decode(buf.subarray(r.at, end)))
      } catch (err) {
        throw malformed('error body is not valid JSON', err)
      }
      const o = v as Record<string, unknown> | null
      if (o === null || typeof o !== 'object' || typeof o.name !== 'string' || typeof o.code !== 'string' || typeof o.message !== 'string') throw malformed('error body is malformed')
      return { kind, requestId, error: { name: o.name, code: o.code, message: o.message } }
    }
  }
}

/**
 * Splits a byte stream into payloads: push bytes as they come, get every complete payload back;
 * a length over `maxFrameBytes` (or a length prefix over 5 bytes) throws SHOAL_ERR_KV_TOO_LARGE
 * at once, before any of that frame is buffered.
 */
export function createFrameSplitter (maxFrameBytes: number = MAX_FRAME_BYTES): { push (bytes: Uint8Array | Uint8ArrayList): Uint8Array[], buffered (): number } {
  const buf = new Uint8ArrayList()
  return {
    push (bytes) {
      buf.append(bytes)
      const out: Uint8Array[] = []
      while (buf.byteLength > 0) {
        let len = 0
        let scale = 1
        let i = 0
        for (; i < buf.byteLength; i++) {
          if (i >= 5) throw fail('SHOAL_ERR_KV_TOO_LARGE', 'frame length prefix is too long')
          const b = buf.get(i)
          len += (b & 0x7f) * scale
          if ((b & 0x80) === 0) break
          scale *= 128
        }
        if (i === buf.byteLength) break
        if (len > maxFrameBytes) throw fail('SHOAL_ERR_KV_TOO_LARGE', `incoming frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`)
        if (buf.byteLength < i + 1 + len) break
        // A copy of its own (subarray may return a view of a larger received buffer).
        out.push(buf.slice(i + 1, i + 1 + len))
        buf.consume(i + 1 + len)
      }
      return out
    },
    buffered: () => buf.byteLength,
  }
}

/** What a holder sends for one pull. */
export interface PrefixTransfer extends KvScopeFields {
  requestId: string
  /** Positions moved: the first `tokens` of the pull's token ids. */
  tokens: number
  numKvHeads: number
  headDim: number
  blockSize: number
  /** exactPrefixHashes over the scope and the moved tokens. */
  hashes: Uint8Array[]
  /** Per layer, key then value, each [numKvHeads, tokens, headDim]. */
  tensors: readonly Float32Array[]
  maxChunkBytes: number
}

/** The holder's answer to a pull as frames: header, chunks in order, end. Tensor bytes are views, not copies. */
export function * transferFrames (t: PrefixTransfer): Generator<KvFrame> {
  const per = Math.max(1, Math.floor(Math.min(t.maxChunkBytes, MAX_CHUNK_BYTES) / 4))
  const size = t.numKvHeads * t.tokens * t.headDim
  const layerCount = t.layers[1] - t.layers[0] + 1
  if (t.tensors.length !== 2 * layerCount || t.tensors.some(x => x.length !== size)) throw malformed(`a transfer needs ${2 * layerCount} tensors of ${size} values`)
  const chunks = 2 * layerCount * Math.ceil(size / per)
  const { tensors, ...rest } = t
  yield { kind: 'header', requestId: t.requestId, manifestHash: rest.manifestHash, layers: rest.layers, dtype: rest.dtype, tokens: t.tokens, numKvHeads: t.numKvHeads, headDim: t.headDim, blockSize: t.blockSize, chunks, hashes: t.hashes }
  let seq = 0
  for (let i = 0; i < tensors.length; i++) {
    const x = tensors[i]!
    for (let offset = 0; offset < size; offset += per) {
      const count = Math.min(per, size - offset)
      const data = new Uint8Array(x.buffer, x.byteOffset + offset * 4, count * 4)
      yield { kind: 'chunk', requestId: t.requestId, seq: seq++, layer: t.layers[0] + (i >> 1), part: (i & 1) as 0 | 1, offset, data }
    }
  }
  yield { kind: 'end', requestId: t.requestId, chunks }
}

/** What a puller knows before any byte arrives, and checks every frame against. */
export interface PrefixExpectation extends KvScopeFields {
  requestId: string
  numKvHeads: number
  headDim: number
  blockSize: number
  /** The token ids asked for (the pull frame's). */
  tokens: readonly number[]
  /** The largest chunk (tensor bytes) the puller asked for. */
  maxChunkBytes: number
}

/** A validated transfer: the first `tokens` positions' KV, laid out as PrefixTransfer.tensors. */
export interface ReceivedPrefix {
  tokens: number
  tensors: Float32Array[]
  bytes: number
}

export interface PrefixReceiver {
  /**
   * Takes the next frame. Returns the prefix after a valid `end`; throws a KvWireError for any
   * frame that is out of order or disagrees with the expectation, and the holder's own error
   * (its code) for an error frame.
   */
  accept (frame: KvFrame): ReceivedPrefix | undefined
  /** The stream ended: throws SHOAL_ERR_KV_TRUNCATED unless the transfer was complete. */
  finish (): ReceivedPrefix
}

const sameBytes = (a: Uint8Array, b: Uint8Array): boolean => a.length === b.length && a.every((x, i) => x === b[i])

/**
 * The puller's side of one transfer as a pure state machine: header checked against its own
 * scope, shapes and token ids (hashes recomputed here), chunks only in order and inside their
 * tensor, the chunk count confirmed at the end. Nothing it returns was not checked.
 */
export function createPrefixReceiver (x: PrefixExpectation): PrefixReceiver {
  const scope = prefixScope({ manifestHash: x.manifestHash, layers: [x.layers[0], x.layers[1]], dtype: x.dtype })
  const layerCount = x.layers[1] - x.layers[0] + 1
  const maxCount = Math.floor(Math.min(x.maxChunkBytes, MAX_CHUNK_BYTES) / 4)
  let state: 'header' | 'chunks' | 'done' = 'header'
  let header: Extract<KvFrame, { kind: 'header' }> | undefined
  let tensors: Float32Array[] = []
  let size = 0
  /** The next chunk's tensor (index into tensors), offset and seq. */
  let tensor = 0
  let offset = 0
  let seq = 0
  let result: ReceivedPrefix | undefined
  const mismatch = (message: string): KvWireError => fail('SHOAL_ERR_KV_MISMATCH', message)
  const unexpected = (message: string): KvWireError => fail('SHOAL_ERR_KV_UNEXPECTED_FRAME', message)

  function onHeader (h: Extract<KvFrame, { kind: 'header' }>): void {
    if (h.manifestHash !== x.manifestHash || h.dtype !== x.dtype || h.layers[0] !== x.layers[0] || h.layers[1] !== x.layers[1]) {
      throw mismatch(`holder sends KV of ${h.manifestHash} layers ${h.layers[0]}-${h.layers[1]} ${h.dtype}; this stage is ${x.manifestHash} layers ${x.layers[0]}-${x.layers[1]} ${x.dtype}`)
    }
    if (h.numKvHeads !== x.numKvHeads || h.headDim !== x.headDim) throw mismatch(`holder's KV is ${h.numKvHeads} heads × ${h.headDim}; this stage's is ${x.numKvHeads} × ${x.headDim}`)
    if (h.blockSize !== x.blockSize) throw mismatch(`holder hashed blocks of ${h.blockSize} tokens, not ${x.blockSize}`)
    if (h.tokens < 1 || h.tokens > x.tokens.length) throw mismatch(`holder sends ${h.tokens} positions of the ${x.tokens.length} asked for`)
    const mine = exactPrefixHashes(scope, x.tokens.slice(0, h.tokens), x.blockSize)
    if (h.hashes.length !== mine.length) throw mismatch(`holder sends ${h.hashes.length} block hashes for ${h.tokens} tokens; ${mine.length} expected`)
    const bad = mine.findIndex((m, i) => !sameBytes(m, h.hashes[i]!))
    if (bad >= 0) throw mismatch(`block ${bad}'s hash differs: the holder's KV is not of these tokens in this scope`)
    size = x.numKvHeads * h.tokens * x.headDim
    // Each tensor in at least one chunk, each chunk at least one value.
    if (h.chunks < 2 * layerCount || h.chunks > 2 * layerCount * size) throw mismatch(`${h.chunks} chunks cannot carry ${2 * layerCount} tensors of ${size} values`)
    tensors = Array.from({ length: 2 * layerCount }, () => new Float32Array(size))
    header = h
    state = 'chunks'
  }

  function onChunk (c: Extract<KvFrame, { kind: 'chunk' }>): void {
    const count = c.data.length / 4
    const layer = x.layers[0] + (tensor >> 1)
    if (c.seq !== seq) throw unexpected(`chunk ${c.seq} arrived where chunk ${seq} belongs`)
    if (tensor >= tensors.length) throw unexpected('a chunk after every tensor was complete')
    if (c.layer !== layer || c.part !== (tensor & 1) || c.offset !== offset) {
      throw unexpected(`chunk ${c.seq} is layer ${c.layer} part ${c.part} offset ${c.offset}; layer ${layer} part ${tensor & 1} offset ${offset} belongs there`)
    }
    if (count > maxCount) throw fail('SHOAL_ERR_KV_TOO_LARGE', `chunk ${c.seq} carries ${count * 4} bytes; at most ${maxCount * 4} were asked for`)
    if (offset + count > size) throw mismatch(`chunk ${c.seq} runs ${offset + count - size} values past its tensor`)
    new Uint8Array(tensors[tensor]!.buffer).set(c.data, offset * 4)
    seq++
    offset += count
    if (offset === size) { tensor++; offset = 0 }
  }

  return {
    accept (frame) {
      if (frame.requestId !== x.requestId) throw unexpected(`a frame for request ${frame.requestId}, not ${x.requestId}`)
      if (frame.kind === 'error') throw deserializeError(frame.error)
      switch (state) {
        case 'header':
          if (frame.kind !== 'header') throw unexpected(`a ${frame.kind} frame before the header`)
          onHeader(frame)
          return undefined
        case 'chunks':
          if (frame.kind === 'chunk') { onChunk(frame); return undefined }
          if (frame.kind !== 'end') throw unexpected(`a ${frame.kind} frame during the transfer`)
          if (tensor < tensors.length) throw fail('SHOAL_ERR_KV_TRUNCATED', `the transfer ended after ${seq} chunks, with tensor ${tensor} incomplete`)
          if (frame.chunks !== header!.chunks || seq !== header!.chunks) throw mismatch(`${seq} chunks arrived; the header said ${header!.chunks} and the end ${frame.chunks}`)
          state = 'done'
          result = { tokens: header!.tokens, tensors, bytes: tensors.reduce((n, t) => n + t.byteLength, 0) }
          return result
        case 'done':
          throw unexpected(`a ${frame.kind} frame after the end`)
      }
    },
    finish () {
      if (result === undefined) throw fail('SHOAL_ERR_KV_TRUNCATED', `the stream ended ${state === 'header' ? 'before the header' : `after ${seq} chunks`}`)
      return result
    },
  }
}
