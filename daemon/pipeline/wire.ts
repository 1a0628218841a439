/**
 * The /shoal/stage/2.0.0 wire format: frames between consecutive stages of a pipeline chain, many
 * requests interleaved on one long-lived stream per neighbour pair.
 *
 * A frame is an unsigned-varint length, then a payload (all integers little-endian):
 *   u8 version (2) | u8 kind | u8 n | n bytes request id (UTF-8; n = 0 only in link-level errors) | body
 * Bodies:
 *   open        JSON (fixed key order): model, manifest hash, the chain, this hop, who gets the
 *               tokens, sampling params, RNG draws to skip (replay), deadline[, receipt id]
 *               [, activations: "f16" | "int8" — the chain's activation encoding; absent = f32]
 *               [, fromKey, fromLength — open the request from the first fromLength positions
 *               of the prefix this stage kept under fromKey (a finish with keep); a stage that no
 *               longer holds it answers SHOAL_ERR_STAGE_PREFIX_GONE and the coordinator reopens
 *               the request without them]
 *               [, pullFrom, fromTokens — a rebuilt chain: the stages at these hops hold the layer
 *               range another peer kept fromKey for, and first pull their layers' part of it from
 *               that peer over /shoal/kv (daemon/kv pull-kept, its block hashes checked against
 *               fromTokens, the prefix's fromLength token ids); a stage that does not pull it
 *               (the cost model says recompute, or the pull fails) answers
 *               SHOAL_ERR_STAGE_PREFIX_GONE as above. Added within version 2 like fromKey: an
 *               open without them is unchanged, and a stage that ignores them answers so too]
 *   activation  u8 flags (bit 0: final — the last stage samples after this one; bit 1: verify) | u8
 *               dtype | u8 rank (2) | zero padding to a 4-byte boundary | u32 start position
 *               | u32 rows | u32 width | with verify: u32 k | k × u32 draft token ids | the tensor
 *               (positions start .. start + rows - 1), by dtype (activations.ts):
 *                 1 = f32: rows × width raw f32
 *                 2 = f16: rows × width binary16 (lossy; only on a chain opened with "f16")
 *                 3 = int8: rows × f32 scale, then rows × width int8 (value = q · scale of its row;
 *                     lossy; only on a chain opened with "int8")
 *               Dtypes 2 and 3 were added within version 2: an f32 frame's bytes are unchanged,
 *               and a chain uses the others only when its open frame asks for them, which a
 *               coordinator does only when every stage's capabilities list the encoding. A stage holding more positions than
 *               `start` first sets the request's KV back to `start` (rejected speculative drafts).
 *               Verify (speculative decoding, version 2): the rows are a token and its k = rows − 1
 *               drafts; the last stage checks the drafts (greedy by id, or sampled: verify.ts).
 *   token       u32 position | u32 token id (the last stage's answer: ids, not logits)
 *   verdict     u32 position | u32 accepted | u32 token id: the last stage's answer to a verify —
 *               how many drafts stand, and its own token after them (at `position`)
 *   error       JSON {name, code, message[, peerId]}
 *   cancel      empty (drop the request's state here and downstream)
 *   finish      empty, or JSON {[keep, length][, evict]}: the request completed — each stage sends
 *               its signed receipt part to the coordinator, then drops the request's state (with
 *               keep: ends the sequence keeping its first `length` positions' KV under the key
 *               `keep`, within the stage's budget; with evict: also drops the coordinator's kept
 *               prefixes of those keys, 1-64, which its index no longer lists) and passes finish
 *               downstream. The body was added within version 2: a finish without one is
 *               byte-for-byte the old frame. [, ack: true — with keep: each stage answers with
 *               a kept frame once its keep is done (added within version 2 like keep: a stage
 *               that ignores it answers nothing, which the coordinator waits out once, bounded)]
 *   part        JSON: one stage's signed receipt part (daemon/ledger/README.md), or {} from a stage
 *               that signs none
 *   kept        JSON {keep, length}: a stage kept `length` positions (0: none) of the finished
 *               request's KV under `keep` — its answer to a finish with keep and ack, sent to the
 *               coordinator after its part; the coordinator holds an open from that key until
 *               every stage answered (keep-acks.ts). Added within version 2: only a coordinator
 *               that asked (ack) is sent one, so no node that predates it receives this kind
 * Tensor bytes start 4-byte aligned within the payload, so a decoder can view them in place.
 */
import type { Uint8ArrayList } from 'uint8arraylist'
import type { SerializedError } from '../errors.ts'
import { joinParts, lengthPrefixed } from '../wire-bytes.ts'
import { StageWireError } from './errors.ts'
import { ACTIVATION_DTYPES, decodeActivation, encodeActivation, encodedBytes, ENCODING_BY_DTYPE } from './activations.ts'

/** 2.0.0: activation frames may carry drafts to verify (speculative decoding), answered by verdict frames. */
export const STAGE_PROTOCOL = '/shoal/stage/2.0.0'
export const STAGE_WIRE_VERSION = 2
/** Kept-prefix keys one finish frame may ask a stage to evict. */
export const MAX_FINISH_EVICT = 64
/** Drafts one verify frame may carry. */
export const MAX_VERIFY_DRAFTS = 255
/** One prefill chunk of a large model's activations fits (256 × 8192 × 4 = 8 MiB). */
export const MAX_FRAME_BYTES = 16 * 1024 * 1024
export const MAX_REQUEST_ID_BYTES = 255
const MAX_ERROR_MESSAGE_CHARS = 2048

const KIND_CODES = { open: 1, activation: 2, token: 3, error: 4, cancel: 5, finish: 6, part: 7, verdict: 8, kept: 9 } as const
export type StageFrameKind = keyof typeof KIND_CODES
const KIND_BY_CODE = new Map(Object.entries(KIND_CODES).map(([k, v]) => [v as number, k as StageFrameKind]))

export interface ChainHop {
  peerId: string
  /** Inclusive global layer range this hop must hold. */
  layers: [number, number]
}

export interface OpenBody {
  modelId: string
  manifestHash: string
  /** The whole chain, stage 0 (the coordinator) first. */
  chain: ChainHop[]
  /** Index in `chain` of the stage this frame is addressed to. */
  hop: number
  /** Peer that receives token and error frames (the coordinator). */
  returnTo: string
  sampling: { temperature: number, topP: number, seed?: number }
  /** RNG draws the last stage skips before sampling (a replay resumes the same random stream). */
  rngSkip: number
  /** Epoch ms; state for the request is dropped after it. */
  deadline: number
  /** The receipt id stages sign their parts with, when it differs from the frames' request id (a replay). */
  receiptId?: string
  /** The chain's lossy activation encoding (every hop sends its activations so); absent: exact f32. */
  activations?: 'f16' | 'int8'
  /** Open from the first `fromLength` positions of the prefix kept under `fromKey` (both or neither). */
  fromKey?: string
  fromLength?: number
  /** Hops (after the first) that pull fromKey's KV of their layers from the peer that kept it first (with fromKey). */
  pullFrom?: StagePull[]
  /** The prefix's token ids, fromLength of them (with pullFrom): what a pulling stage checks the KV's block hashes against. */
  fromTokens?: number[]
}

/** A stage of a rebuilt chain that pulls its layers' part of the kept prefix from `peerId`, which kept it. */
export interface StagePull {
  hop: number
  peerId: string
}

/** What a finish asks each stage to keep of the request's KV (prefix reuse on chains). */
export interface FinishKeep {
  /** The key the coordinator will open later requests from (unique to the coordinator). */
  keep: string
  /** Positions to keep (a stage keeps what it holds, at most these). */
  length: number
  /** Each stage answers with a kept frame once its keep is done (the coordinator's open from the key waits for it). */
  ack?: true
}

export type StageFrame =
  | { kind: 'open', requestId: string, open: OpenBody }
  /**
   * `drafts`: a verify (rows = drafts.length + 1, final). `encoding`: how the tensor travels (and
   * travelled, on a decoded frame); absent: f32. `data` is always the f32 values.
   */
  | { kind: 'activation', requestId: string, start: number, final: boolean, rows: number, width: number, data: Float32Array, drafts?: number[], encoding?: 'f16' | 'int8' }
  | { kind: 'token', requestId: string, position: number, tokenId: number }
  | { kind: 'verdict', requestId: string, position: number, accepted: number, tokenId: number }
  /** `peerId`: the stage peer an error is about (a lost link names it, so a replay avoids it). */
  | { kind: 'error', requestId: string, error: SerializedError & { peerId?: string } }
  | { kind: 'cancel', requestId: string }
  /** `keep`: keep the request's KV as a prefix; `evict`: the coordinator's kept prefixes to drop (1-MAX_FINISH_EVICT keys). */
  | { kind: 'finish', requestId: string, keep?: FinishKeep, evict?: string[] }
  | { kind: 'part', requestId: string, part: Record<string, unknown> }
  /** A stage's answer to a finish with keep and ack: it kept `length` positions (0: none) under `keep`. */
  | { kind: 'kept', requestId: string, keep: string, length: number }

if (new Uint8Array(Uint16Array.of(1).buffer)[0] !== 1) throw new Error('the stage wire format assumes a little-endian host')

const utf8 = new TextEncoder()
const utf8Strict = new TextDecoder('utf-8', { fatal: true })
const malformed = (message: string, cause?: unknown): StageWireError =>
  new StageWireError('SHOAL_ERR_STAGE_MALFORMED', message, cause === undefined ? undefined : { cause })
const truncated = (message: string): StageWireError => new StageWireError('SHOAL_ERR_STAGE_TRUNCATED', message)
const isU32 = (n: unknown): n is number => Number.isInteger(n) && (n as number) >= 0 && (n as number) < 2 ** 32



function encodeOpen (o: OpenBody): Uint8Array {
  const sampling = o.sampling.seed === undefined
    ? { temperature: o.sampling.temperature, topP: o.sampling.topP }
    : { temperature: o.sampling.temperature, topP: o.sampling.topP, seed: o.sampling.seed }
  return utf8.encode(JSON.stringify({
    modelId: o.modelId,
    manifestHash: o.manifestHash,
    chain: o.chain.map(h => ({ peerId: h.peerId, layers: [h.layers[0], h.layers[1]] })),
    hop: o.hop,
    returnTo: o.returnTo,
    sampling,
    rngSkip: o.rngSkip,
    deadline: o.deadline,
    ...(o.receiptId === undefined ? {} : { receiptId: o.receiptId }),
    ...(o.activations === undefined ? {} : { activations: o.activations }),
    ...(o.fromKey === undefined ? {} : { fromKey: o.fromKey, fromLength: o.fromLength }),
    ...(o.pullFrom === undefined ? {} : { pullFrom: o.pullFrom.map(p => ({ hop: p.hop, peerId: p.peerId })), fromTokens: o.fromTokens }),
  }))
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v)
const isStr = (v: unknown): v is string => typeof v === 'string' && v.length > 0 && v.length <= 256
const isNum = (v: unknown): v is number => typeof v === 'number' && Number.isFinite(v)
const validEvict = (v: unknown): v is string[] => Array.isArray(v) && v.length >= 1 && v.length <= MAX_FINISH_EVICT && v.every(isStr)

function decodeOpen (v: unknown): OpenBody {
  if (!isObj(v) || !isStr(v.modelId) || !isStr(v.manifestHash) || !isStr(v.returnTo) || !isNum(v.deadline)) throw malformed('open body: bad model, manifest hash, returnTo or deadline')
  if (!Array.isArray(v.chain) || v.chain.length < 2 || v.chain.length > 64) throw malformed('open body: chain must list 2-64 stages')
  const chain = v.chain.map((h: unknown): ChainHop => {
    if (!isObj(h) || !isStr(h.peerId) || !Array.isArray(h.layers) || h.layers.length !== 2 || !isU32(h.layers[0]) || !isU32(h.layers[1]) || h.layers[0] > h.layers[1]) {
      throw malformed('open body: bad chain hop')
    }
    return { peerId: h.peerId, layers: [h.layers[0], h.layers[1]] }
  })
  if (!Number.isInteger(v.hop) || (v.hop as number) < 1 || (v.hop as number) >= chain.length) throw malformed('open body: hop must index a stage after the first')
  const s = v.sampling
  if (!isObj(s) || !isNum(s.temperature) || s.temperature < 0 || !isNum(s.topP) || (s.seed !== undefined && !Number.isSafeInteger(s.seed))) throw malformed('open body: bad sampling params')
  if (!isU32(v.rngSkip)) throw malformed('open body: rngSkip must be a u32')
  const sampling = s.seed === undefined ? { temperature: s.temperature, topP: s.topP } : { temperature: s.temperature, topP: s.topP, seed: s.seed as number }
  if (v.receiptId !== undefined && !isStr(v.receiptId)) throw malformed('open body: bad receiptId')
  if (v.activations !== undefined && v.activations !== 'f16' && v.activations !== 'int8') throw malformed('open body: activations must be "f16" or "int8" (absent: f32)')
  if ((v.fromKey === undefined) !== (v.fromLength === undefined) || (v.fromKey !== undefined && (!isStr(v.fromKey) || !isU32(v.fromLength) || v.fromLength === 0))) {
    throw malformed('open body: fromKey (a key) and fromLength (> 0) come together')
  }
  const open: OpenBody = { modelId: v.modelId, manifestHash: v.manifestHash, chain, hop: v.hop as number, returnTo: v.returnTo, sampling, rngSkip: v.rngSkip, deadline: v.deadline }
  if (v.receiptId !== undefined) open.receiptId = v.receiptId
  if (v.activations !== undefined) open.activations = v.activations
  if (v.fromKey !== undefined) { open.fromKey = v.fromKey as string; open.fromLength = v.fromLength as number }
  if (v.pullFrom !== undefined || v.fromTokens !== undefined) {
    const pulls = v.pullFrom
    const ids = v.fromTokens
    if (open.fromKey === undefined || !Array.isArray(pulls) || !Array.isArray(ids)) throw malformed('open body: pullFrom and fromTokens come together, with fromKey')
    if (ids.length !== open.fromLength || !ids.every(isU32)) throw malformed('open body: fromTokens must be fromLength token ids')
    const seen = new Set<number>()
    open.pullFrom = pulls.map((p: unknown): StagePull => {
      if (!isObj(p) || !Number.isInteger(p.hop) || (p.hop as number) < 1 || (p.hop as number) >= chain.length || seen.has(p.hop as number) || !isStr(p.peerId) || p.peerId === chain[p.hop as number]!.peerId) {
        throw malformed('open body: a pullFrom entry must name a later hop once, and a peer other than that hop\'s')
      }
      seen.add(p.hop as number)
      return { hop: p.hop as number, peerId: p.peerId }
    })
    if (open.pullFrom.length === 0) throw malformed('open body: pullFrom lists no hop')
    open.fromTokens = ids as number[]
  }
  return open
}

function parseJson (body: Uint8Array, kind: string): unknown {
  try {
    return JSON.parse(utf8Strict.decode(body))
  } catch (err) {
    throw malformed(`${kind} body is not valid JSON`, err)
  }
}

/** Header (version, kind, request id) as bytes, with `extra` bytes of room after it. */
function header (kind: StageFrameKind, requestId: string, extra: number): { out: Uint8Array, at: number } {
  const id = utf8.encode(requestId)
  if (id.length > MAX_REQUEST_ID_BYTES || (id.length === 0 && kind !== 'error')) throw malformed(`request id must be 1-${MAX_REQUEST_ID_BYTES} bytes`)
  const out = new Uint8Array(3 + id.length + extra)
  out[0] = STAGE_WIRE_VERSION
  out[1] = KIND_CODES[kind]
  out[2] = id.length
  out.set(id, 3)
  return { out, at: 3 + id.length }
}

/**
 * The payload as one or two parts: an activation's tensor bytes are not copied (the second part
 * is a view of `data`).
 */
export function encodePayloadParts (f: StageFrame): Uint8Array[] {
  switch (f.kind) {
    case 'activation': {
      if (!isU32(f.start) || !isU32(f.rows) || !isU32(f.width) || f.rows === 0 || f.width === 0) throw malformed('activation: start, rows and width must be u32, rows and width > 0')
      if (f.data.length !== f.rows * f.width) throw malformed(`activation: ${f.data.length} values for ${f.rows} × ${f.width}`)
      const drafts = f.drafts
      if (drafts !== undefined) {
        if (!f.final || drafts.length + 1 !== f.rows || drafts.length > MAX_VERIFY_DRAFTS || !drafts.every(isU32)) throw malformed(`activation: a verify is final and carries rows − 1 (≤ ${MAX_VERIFY_DRAFTS}) u32 drafts`)
      }
      const idLen = utf8.encode(f.requestId).length
      const pad = (4 - ((3 + idLen + 3) % 4)) % 4
      const extra = drafts === undefined ? 0 : 4 + 4 * drafts.length
      const { out, at } = header('activation', f.requestId, 3 + pad + 12 + extra)
      out[at] = (f.final ? 1 : 0) | (drafts === undefined ? 0 : 2)
      const encoding = f.encoding ?? 'f32'
      out[at + 1] = ACTIVATION_DTYPES[encoding]
      out[at + 2] = 2
      const dv = new DataView(out.buffer, out.byteOffset + at + 3 + pad, 12 + extra)
      dv.setUint32(0, f.start, true)
      dv.setUint32(4, f.rows, true)
      dv.setUint32(8, f.width, true)
      if (drafts !== undefined) {
        dv.setUint32(12, drafts.length, true)
        drafts.forEach((t, i) => dv.setUint32(16 + 4 * i, t, true))
      }
      if (encoding === 'f32') return [out, new Uint8Array(f.data.buffer, f.data.byteOffset, f.data.byteLength)]
      const tensor = new Uint8Array(encodedBytes(encoding, f.rows, f.width))
      encodeActivation(encoding, f.data, f.rows, f.width, tensor)
      return [out, tensor]
    }
    case 'token': {
      if (!isU32(f.position) || !isU32(f.tokenId)) throw malformed('token: position and token id must be u32')
      const { out, at } = header('token', f.requestId, 8)
      const dv = new DataView(out.buffer, out.byteOffset + at, 8)
      dv.setUint32(0, f.position, true)
      dv.setUint32(4, f.tokenId, true)
      return [out]
    }
    case 'verdict': {
      if (!isU32(f.position) || !isU32(f.accepted) || !isU32(f.tokenId)) throw malformed('verdict: position, accepted and token id must be u32')
      const { out, at } = header('verdict', f.requestId, 12)
      const dv = new DataView(out.buffer, out.byteOffset + at, 12)
      dv.setUint32(0, f.position, true)
      dv.setUint32(4, f.accepted, true)
      dv.setUint32(8, f.tokenId, true)
      return [out]
    }
    case 'cancel': return [header(f.kind, f.requestId, 0).out]
    case 'finish': {
      if (f.keep === undefined && f.evict === undefined) return [header(f.kind, f.requestId, 0).out]
      if (f.keep !== undefined && (!isStr(f.keep.keep) || !isU32(f.keep.length) || f.keep.length === 0)) throw malformed('finish: keep needs a key and a length > 0')
      if (f.evict !== undefined && !validEvict(f.evict)) throw malformed(`finish: evict lists 1-${MAX_FINISH_EVICT} keys`)
      const body = utf8.encode(JSON.stringify({
        ...(f.keep === undefined ? {} : { keep: f.keep.keep, length: f.keep.length }),
        ...(f.evict === undefined ? {} : { evict: f.evict }),
        ...(f.keep?.ack === true ? { ack: true } : {}),
      }))
      const { out, at } = header('finish', f.requestId, body.length)
      out.set(body, at)
      return [out]
    }
    case 'kept': {
      if (!isStr(f.keep) || !isU32(f.length)) throw malformed('kept: a key and a u32 length')
      const body = utf8.encode(JSON.stringify({ keep: f.keep, length: f.length }))
      const { out, at } = header('kept', f.requestId, body.length)
      out.set(body, at)
      return [out]
    }
    case 'part': {
      const body = utf8.encode(JSON.stringify(f.part))
      const { out, at } = header('part', f.requestId, body.length)
      out.set(body, at)
      return [out]
    }
    case 'open':
    case 'error': {
      const body = f.kind === 'open'
        ? encodeOpen(f.open)
        : utf8.encode(JSON.stringify({
          name: f.error.name,
          code: f.error.code,
          message: f.error.message.slice(0, MAX_ERROR_MESSAGE_CHARS),
          ...(f.error.peerId === undefined ? {} : { peerId: f.error.peerId }),
        }))
      const { out, at } = header(f.kind, f.requestId, body.length)
      out.set(body, at)
      return [out]
    }
  }
}

/** The frame as it goes on the stream: varint length, then the payload (parts, not concatenated). */
export function encodeFrameParts (f: StageFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array[] {
  return lengthPrefixed(encodePayloadParts(f), maxFrameBytes, len => new StageWireError('SHOAL_ERR_STAGE_TOO_LARGE', `${f.kind} frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`))
}

/** The frame as one contiguous byte array (tests, golden bytes). */
export function encodeFrame (f: StageFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array {
  return joinParts(encodeFrameParts(f, maxFrameBytes))
}

/** Reads the request id of a payload that may fail to decode otherwise (so an error can name it). */
export function peekRequestId (buf: Uint8Array): string | undefined {
  const n = buf[2]
  if (n === undefined || n === 0 || buf.length < 3 + n) return undefined
  try { return utf8Strict.decode(buf.subarray(3, 3 + n)) } catch { return undefined }
}

/** Decodes one payload (the bytes inside a length prefix). Tensor data is a view when aligned. */
export function decodePayload (payload: Uint8Array | Uint8ArrayList): StageFrame {
  const buf = payload instanceof Uint8Array ? payload : payload.subarray()
  if (buf.length < 3) throw truncated(`frame of ${buf.length} bytes is shorter than its header`)
  if (buf[0] !== STAGE_WIRE_VERSION) throw new StageWireError('SHOAL_ERR_STAGE_UNSUPPORTED_VERSION', `stage frame version ${buf[0]} is not supported (this node speaks ${STAGE_WIRE_VERSION})`)
  const kind = KIND_BY_CODE.get(buf[1] as number)
  if (kind === undefined) throw new StageWireError('SHOAL_ERR_STAGE_UNKNOWN_KIND', `unknown stage frame kind ${buf[1]}`)
  const idLen = buf[2] as number
  if (idLen === 0 && kind !== 'error') throw malformed('request id is empty')
  if (buf.length < 3 + idLen) throw truncated('frame ends inside its request id')
  let requestId: string
  try {
    requestId = utf8Strict.decode(buf.subarray(3, 3 + idLen))
  } catch (err) {
    throw malformed('request id is not valid UTF-8', err)
  }
  const at = 3 + idLen
  const body = buf.subarray(at)
  switch (kind) {
    case 'open': return { kind, requestId, open: decodeOpen(parseJson(body, kind)) }
    case 'error': {
      const v = parseJson(body, kind)
      if (!isObj(v) || typeof v.name !== 'string' || typeof v.code !== 'string' || typeof v.message !== 'string' || (v.peerId !== undefined && !isStr(v.peerId))) throw malformed('error body is malformed')
      const error = { name: v.name, code: v.code, message: v.message }
      return { kind, requestId, error: v.peerId === undefined ? error : { ...error, peerId: v.peerId } }
    }
    case 'cancel':
      if (body.length !== 0) throw malformed(`${kind} frame has a body`)
      return { kind, requestId }
    case 'finish': {
      if (body.length === 0) return { kind, requestId }
      const v = parseJson(body, kind)
      if (!isObj(v) || (v.keep === undefined && v.evict === undefined) || (v.keep === undefined) !== (v.length === undefined)) throw malformed('finish body must be {[keep, length][, evict]}')
      if (v.keep !== undefined && (!isStr(v.keep) || !isU32(v.length) || v.length === 0)) throw malformed('finish body: keep needs a key and a length > 0')
      if (v.evict !== undefined && !validEvict(v.evict)) throw malformed(`finish body: evict lists 1-${MAX_FINISH_EVICT} keys`)
      const f: Extract<StageFrame, { kind: 'finish' }> = { kind, requestId }
      if (v.ack !== undefined && (v.ack !== true || v.keep === undefined)) throw malformed('finish body: ack is true, with keep')
      if (v.keep !== undefined) f.keep = { keep: v.keep as string, length: v.length as number, ...(v.ack === true ? { ack: true as const } : {}) }
      if (v.evict !== undefined) f.evict = v.evict as string[]
      return f
    }
    case 'part': {
      const v = parseJson(body, kind)
      if (!isObj(v)) throw malformed('part body must be a JSON object')
      return { kind, requestId, part: v }
    }
    case 'kept': {
      const v = parseJson(body, kind)
      if (!isObj(v) || !isStr(v.keep) || !isU32(v.length)) throw malformed('kept body must be {keep, length}')
      return { kind, requestId, keep: v.keep, length: v.length }
    }
    case 'token': {
      if (body.length !== 8) throw body.length < 8 ? truncated('token frame is short') : malformed('token frame is too long')
      const dv = new DataView(body.buffer, body.byteOffset, 8)
      return { kind, requestId, position: dv.getUint32(0, true), tokenId: dv.getUint32(4, true) }
    }
    case 'verdict': {
      if (body.length !== 12) throw body.length < 12 ? truncated('verdict frame is short') : malformed('verdict frame is too long')
      const dv = new DataView(body.buffer, body.byteOffset, 12)
      return { kind, requestId, position: dv.getUint32(0, true), accepted: dv.getUint32(4, true), tokenId: dv.getUint32(8, true) }
    }
    case 'activation': {
      const pad = (4 - ((at + 3) % 4)) % 4
      let dataAt = 3 + pad + 12
      if (body.length < dataAt) throw truncated('activation header is short')
      const encoding = ENCODING_BY_DTYPE.get(body[1] as number)
      if (encoding === undefined) throw malformed(`activation dtype ${body[1]} is not supported (1 = f32, 2 = f16, 3 = int8)`)
      if (body[2] !== 2) throw malformed(`activation rank ${body[2]} is not 2`)
      const flags = body[0] as number
      if (flags > 3) throw malformed('activation has unknown flags')
      const dv = new DataView(body.buffer, body.byteOffset + 3 + pad, 12)
      const start = dv.getUint32(0, true)
      const rows = dv.getUint32(4, true)
      const width = dv.getUint32(8, true)
      if (rows === 0 || width === 0) throw malformed('activation has an empty shape')
      let drafts: number[] | undefined
      if ((flags & 2) !== 0) {
        if ((flags & 1) === 0) throw malformed('a verify activation must be final')
        if (body.length < dataAt + 4) throw truncated('verify drafts are short')
        const k = new DataView(body.buffer, body.byteOffset + dataAt, 4).getUint32(0, true)
        if (k > MAX_VERIFY_DRAFTS || k + 1 !== rows) throw malformed(`a verify of ${rows} rows carries ${k} drafts`)
        if (body.length < dataAt + 4 + 4 * k) throw truncated('verify drafts are short')
        const ids = new DataView(body.buffer, body.byteOffset + dataAt + 4, 4 * k)
        drafts = Array.from({ length: k }, (_, i) => ids.getUint32(4 * i, true))
        dataAt += 4 + 4 * k
      }
      const bytes = encodedBytes(encoding, rows, width)
      const have = body.length - dataAt
      if (have !== bytes) throw have < bytes ? truncated(`activation holds ${have} of ${bytes} tensor bytes`) : malformed(`activation has ${have - bytes} bytes past its tensor`)
      const offset = body.byteOffset + dataAt
      // Zero-copy when the bytes sit 4-byte aligned in their buffer; otherwise one copy.
      let data: Float32Array
      if (encoding !== 'f32') {
        data = decodeActivation(encoding, body.subarray(dataAt), rows, width)
        const base = { kind, requestId, start, rows, width, data, encoding }
        return drafts === undefined ? { ...base, final: (flags & 1) === 1 } : { ...base, final: true, drafts }
      }
      if (offset % 4 === 0) {
        data = new Float32Array(body.buffer, offset, rows * width)
      } else {
        data = new Float32Array(rows * width)
        new Uint8Array(data.buffer).set(body.subarray(dataAt))
      }
      return drafts === undefined
        ? { kind, requestId, start, final: (flags & 1) === 1, rows, width, data }
        : { kind, requestId, start, final: true, rows, width, data, drafts }
    }
  }
}
