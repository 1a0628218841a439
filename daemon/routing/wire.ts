/**
 * The /shoal/infer/1.0.0 wire format: how one GenerateRequest and its events travel between the
 * node that took the HTTP request and the node that runs it. One libp2p stream per request.
 *
 * Every frame is length-prefixed (unsigned varint, it-length-prefixed) and capped; its payload is
 *   u8 version (1) | u8 kind | varint n | n bytes request id (UTF-8) | body
 * Bodies: request, start, end, error — JSON with a fixed key order; delta — varint count, that many
 * varint token ids, then the text as UTF-8 (the hot path, one per token); cancel — empty.
 * Conversation: client → request, then maybe cancel; server → start, delta*, end | error.
 * Optional JSON fields are written only when present (old frames keep their bytes) and decoders
 * ignore fields they do not know, so adding one does not change the version: the request's
 * `prefixHolder` and `soleServer` and the start's `prefix` came that way.
 */
import * as lp from 'it-length-prefixed'
import type { Uint8ArrayList } from 'uint8arraylist'
import type { SerializedError } from '../errors.ts'
import { varintLength, writeVarint } from '../wire-bytes.ts'
import type { ChatMessage, GenerateEvent, GenerateRequest, PromptInput } from '../service.ts'
import { InferWireError } from './errors.ts'

export const INFER_PROTOCOL = '/shoal/infer/1.0.0'
export const INFER_WIRE_VERSION = 1
/** Large enough for a long prompt given as token ids; small enough to bound every buffer. */
export const MAX_FRAME_BYTES = 4 * 1024 * 1024
export const MAX_REQUEST_ID_BYTES = 256
/** Error messages are cut here so an error frame always fits. */
const MAX_ERROR_MESSAGE_CHARS = 4096
/** The request field an error names (OpenAI's `param`), e.g. `max_tokens`; optional, after retryAfterMs. */
const MAX_ERROR_PARAM_CHARS = 256

/** Bound on route hops and receipt parts a frame may carry (one per executing node). */
const MAX_HOPS = 64

const KIND_CODES = { request: 1, start: 2, delta: 3, end: 4, error: 5, cancel: 6 } as const
export type InferFrameKind = keyof typeof KIND_CODES
const KIND_BY_CODE = new Map(Object.entries(KIND_CODES).map(([k, v]) => [v as number, k as InferFrameKind]))

type StartEvent = Extract<GenerateEvent, { type: 'start' }>
type DeltaEvent = Extract<GenerateEvent, { type: 'delta' }>
type EndEvent = Extract<GenerateEvent, { type: 'end' }>

export type InferFrame =
  | { kind: 'request', requestId: string, request: GenerateRequest }
  | { kind: 'start', requestId: string, event: StartEvent }
  | { kind: 'delta', requestId: string, event: DeltaEvent }
  | { kind: 'end', requestId: string, event: EndEvent }
  | { kind: 'error', requestId: string, error: SerializedError }
  | { kind: 'cancel', requestId: string }

const utf8 = new TextEncoder()
const utf8Strict = new TextDecoder('utf-8', { fatal: true })

function malformed (message: string, cause?: unknown): InferWireError {
  return new InferWireError('SHOAL_ERR_INFER_MALFORMED', message, cause === undefined ? undefined : { cause })
}

// --- varints (unsigned LEB128, up to 2^53; writing in ../wire-bytes.ts) ---

function readVarint (buf: Uint8Array, offset: number): [number, number] {
  let n = 0
  let scale = 1
  for (let i = 0; i < 8; i++) {
    const b = buf[offset + i]
    if (b === undefined) throw malformed('varint runs past the end of the frame')
    n += (b & 0x7f) * scale
    if ((b & 0x80) === 0) return [n, offset + i + 1]
    scale *= 128
  }
  throw malformed('varint too long')
}

// --- bodies ---

function encodeRequest (r: GenerateRequest): unknown {
  const prompt: unknown = r.prompt.kind === 'chat'
    ? { kind: 'chat', messages: r.prompt.messages.map(m => m.name === undefined ? { role: m.role, content: m.content } : { role: m.role, content: m.content, name: m.name }) }
    : r.prompt.kind === 'text' ? { kind: 'text', text: r.prompt.text } : { kind: 'tokens', ids: r.prompt.ids }
  const sampling = r.sampling.seed === undefined
    ? { temperature: r.sampling.temperature, topP: r.sampling.topP }
    : { temperature: r.sampling.temperature, topP: r.sampling.topP, seed: r.sampling.seed }
  return {
    model: r.model,
    prompt,
    ...(r.maxTokens === undefined ? {} : { maxTokens: r.maxTokens }),
    sampling,
    stop: r.stop,
    deadline: r.deadline,
    ...(r.prefixHolder === undefined ? {} : { prefixHolder: { peerId: r.prefixHolder.peerId, cachedTokens: r.prefixHolder.cachedTokens } }),
    ...(r.soleServer === true ? { soleServer: true } : {}),
  }
}

/** A peer id is short; this bounds what a frame may make us keep. */
const MAX_PEER_ID_CHARS = 128

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v)
const isStr = (v: unknown): v is string => typeof v === 'string'
const isNum = (v: unknown): v is number => typeof v === 'number' && Number.isFinite(v)
const isCount = (v: unknown): v is number => Number.isSafeInteger(v) && (v as number) >= 0
const isTokenIds = (v: unknown): v is number[] => Array.isArray(v) && v.every(x => Number.isInteger(x) && x >= 0 && x < 2 ** 32)

function decodePrompt (v: unknown): PromptInput {
  if (!isObj(v)) throw malformed('request.prompt must be an object')
  if (v.kind === 'text' && isStr(v.text)) return { kind: 'text', text: v.text }
  if (v.kind === 'tokens' && isTokenIds(v.ids)) return { kind: 'tokens', ids: v.ids }
  if (v.kind === 'chat' && Array.isArray(v.messages)) {
    const messages: ChatMessage[] = v.messages.map((m: unknown) => {
      if (!isObj(m) || !isStr(m.role) || !isStr(m.content) || (m.name !== undefined && !isStr(m.name))) throw malformed('request.prompt.messages: bad message')
      return m.name === undefined ? { role: m.role, content: m.content } : { role: m.role, content: m.content, name: m.name }
    })
    return { kind: 'chat', messages }
  }
  throw malformed('request.prompt: unknown kind or bad fields')
}

function decodeRequest (requestId: string, v: unknown): GenerateRequest {
  if (!isObj(v)) throw malformed('request body must be an object')
  const s = v.sampling
  if (!isStr(v.model)) throw malformed('request.model must be a string')
  if (v.maxTokens !== undefined && !(Number.isInteger(v.maxTokens) && (v.maxTokens as number) >= 0)) throw malformed('request.maxTokens must be a non-negative integer')
  if (!isObj(s) || !isNum(s.temperature) || !isNum(s.topP) || (s.seed !== undefined && !Number.isInteger(s.seed))) throw malformed('request.sampling is malformed')
  if (!Array.isArray(v.stop) || !v.stop.every(isStr)) throw malformed('request.stop must be an array of strings')
  if (!isNum(v.deadline)) throw malformed('request.deadline must be a number (epoch ms)')
  const sampling = s.seed === undefined ? { temperature: s.temperature, topP: s.topP } : { temperature: s.temperature, topP: s.topP, seed: s.seed as number }
  const req: GenerateRequest = { requestId, model: v.model, prompt: decodePrompt(v.prompt), sampling, stop: v.stop, deadline: v.deadline }
  if (v.maxTokens !== undefined) req.maxTokens = v.maxTokens as number
  if (v.prefixHolder !== undefined) {
    const h = v.prefixHolder
    if (!isObj(h) || !isStr(h.peerId) || h.peerId.length === 0 || h.peerId.length > MAX_PEER_ID_CHARS || !isCount(h.cachedTokens)) throw malformed('request.prefixHolder must be {peerId, cachedTokens}')
    req.prefixHolder = { peerId: h.peerId, cachedTokens: h.cachedTokens }
  }
  if (v.soleServer !== undefined) {
    if (v.soleServer !== true) throw malformed('request.soleServer must be true when present')
    req.soleServer = true
  }
  return req
}

function decodeStart (v: unknown): StartEvent {
  if (!isObj(v) || !isTokenIds(v.promptTokenIds) || !Array.isArray(v.route) || !v.route.every(isStr) || !isStr(v.receiptId)) throw malformed('start body is malformed')
  const ev: StartEvent = { type: 'start', promptTokenIds: v.promptTokenIds, route: v.route, receiptId: v.receiptId }
  if (v.manifestHash !== undefined) {
    if (!isStr(v.manifestHash)) throw malformed('start.manifestHash must be a string')
    ev.manifestHash = v.manifestHash
  }
  if (v.prefix !== undefined) {
    const p = v.prefix
    if (!isObj(p) || !isStr(p.peerId) || p.peerId.length > MAX_PEER_ID_CHARS || !isCount(p.reusedTokens)) throw malformed('start.prefix must be {peerId, reusedTokens, movedFrom?}')
    if (p.movedFrom !== undefined && (!isStr(p.movedFrom) || p.movedFrom.length === 0 || p.movedFrom.length > MAX_PEER_ID_CHARS)) throw malformed('start.prefix.movedFrom must be a peer id')
    ev.prefix = { peerId: p.peerId, reusedTokens: p.reusedTokens, ...(p.movedFrom === undefined ? {} : { movedFrom: p.movedFrom }) }
  }
  if (v.hops !== undefined) {
    if (!Array.isArray(v.hops) || v.hops.length > MAX_HOPS) throw malformed('start.hops must be a short array')
    ev.hops = v.hops.map((h: unknown) => {
      if (!isObj(h) || !isStr(h.peerId)) throw malformed('start.hops: bad hop')
      if (h.layers === undefined) return { peerId: h.peerId }
      if (!Array.isArray(h.layers) || h.layers.length !== 2 || !h.layers.every(n => Number.isInteger(n))) throw malformed('start.hops: bad layer range')
      return { peerId: h.peerId, layers: [h.layers[0] as number, h.layers[1] as number] }
    })
  }
  return ev
}

function decodeEnd (v: unknown): EndEvent {
  const u = isObj(v) ? v.usage : undefined
  if (!isObj(v) || (v.finishReason !== 'stop' && v.finishReason !== 'length') || !isObj(u) ||
    !Number.isInteger(u.promptTokens) || !Number.isInteger(u.completionTokens)) throw malformed('end body is malformed')
  const ev: EndEvent = { type: 'end', finishReason: v.finishReason, usage: { promptTokens: u.promptTokens as number, completionTokens: u.completionTokens as number } }
  if (v.receiptParts !== undefined) {
    // Signed by the executing peers; the ledger checks each signature when it embeds them.
    if (!Array.isArray(v.receiptParts) || v.receiptParts.length > MAX_HOPS || !v.receiptParts.every(isObj)) throw malformed('end.receiptParts must be a short array of objects')
    ev.receiptParts = v.receiptParts
  }
  return ev
}

function decodeError (v: unknown): SerializedError {
  if (!isObj(v) || !isStr(v.name) || !isStr(v.code) || !isStr(v.message)) throw malformed('error body is malformed')
  if (v.retryAfterMs !== undefined && !(isNum(v.retryAfterMs) && v.retryAfterMs >= 0)) throw malformed('error.retryAfterMs must be a non-negative number')
  if (v.param !== undefined && !(isStr(v.param) && v.param.length <= MAX_ERROR_PARAM_CHARS)) throw malformed('error.param must be a short string')
  const out: SerializedError = { name: v.name, code: v.code, message: v.message }
  if (v.retryAfterMs !== undefined) out.retryAfterMs = v.retryAfterMs
  if (v.param !== undefined) out.param = v.param
  return out
}

function encodeDelta (e: DeltaEvent): Uint8Array {
  const text = utf8.encode(e.text)
  let len = varintLength(e.tokenIds.length) + text.length
  for (const id of e.tokenIds) len += varintLength(id)
  const out = new Uint8Array(len)
  let o = writeVarint(out, 0, e.tokenIds.length)
  for (const id of e.tokenIds) o = writeVarint(out, o, id)
  out.set(text, o)
  return out
}

function decodeDelta (body: Uint8Array): DeltaEvent {
  let [count, o] = readVarint(body, 0)
  if (count > body.length) throw malformed('delta token count exceeds the frame')
  const tokenIds: number[] = []
  for (let i = 0; i < count; i++) {
    const [id, next] = readVarint(body, o)
    if (id >= 2 ** 32) throw malformed('delta token id out of range')
    tokenIds.push(id)
    o = next
  }
  let text: string
  try {
    text = utf8Strict.decode(body.subarray(o))
  } catch (err) {
    throw malformed('delta text is not valid UTF-8', err)
  }
  return { type: 'delta', text, tokenIds }
}

function bodyOf (f: InferFrame): Uint8Array {
  switch (f.kind) {
    case 'request': return utf8.encode(JSON.stringify(encodeRequest(f.request)))
    case 'start': return utf8.encode(JSON.stringify({
      promptTokenIds: f.event.promptTokenIds,
      route: f.event.route,
      receiptId: f.event.receiptId,
      // Optional fields are written only when present, so frames without them keep their bytes.
      ...(f.event.manifestHash === undefined ? {} : { manifestHash: f.event.manifestHash }),
      ...(f.event.hops === undefined ? {} : { hops: f.event.hops }),
      ...(f.event.prefix === undefined ? {} : { prefix: { peerId: f.event.prefix.peerId, reusedTokens: f.event.prefix.reusedTokens, ...(f.event.prefix.movedFrom === undefined ? {} : { movedFrom: f.event.prefix.movedFrom }) } }),
    }))
    case 'delta': return encodeDelta(f.event)
    case 'end': return utf8.encode(JSON.stringify({
      finishReason: f.event.finishReason,
      usage: { promptTokens: f.event.usage.promptTokens, completionTokens: f.event.usage.completionTokens },
      ...(f.event.receiptParts === undefined ? {} : { receiptParts: f.event.receiptParts }),
    }))
    case 'error': return utf8.encode(JSON.stringify({
      name: f.error.name,
      code: f.error.code,
      message: f.error.message.slice(0, MAX_ERROR_MESSAGE_CHARS),
      ...(f.error.retryAfterMs === undefined ? {} : { retryAfterMs: f.error.retryAfterMs }),
      ...(f.error.param === undefined ? {} : { param: f.error.param.slice(0, MAX_ERROR_PARAM_CHARS) }),
    }))
    case 'cancel': return new Uint8Array(0)
  }
}

/** The frame's payload (without the length prefix). */
export function encodePayload (f: InferFrame): Uint8Array {
  if (f.kind === 'request' && f.request.requestId !== f.requestId) throw malformed('request frame id differs from request.requestId')
  const id = utf8.encode(f.requestId)
  if (id.length === 0 || id.length > MAX_REQUEST_ID_BYTES) throw malformed(`request id must be 1-${MAX_REQUEST_ID_BYTES} bytes`)
  const body = bodyOf(f)
  const out = new Uint8Array(2 + varintLength(id.length) + id.length + body.length)
  out[0] = INFER_WIRE_VERSION
  out[1] = KIND_CODES[f.kind]
  let o = writeVarint(out, 2, id.length)
  out.set(id, o)
  o += id.length
  out.set(body, o)
  return out
}

/** The frame as it goes on the stream: varint length, then the payload. */
export function encodeFrame (f: InferFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array {
  const payload = encodePayload(f)
  if (payload.length > maxFrameBytes) {
    throw new InferWireError('SHOAL_ERR_INFER_TOO_LARGE', `${f.kind} frame of ${payload.length} bytes exceeds the ${maxFrameBytes}-byte cap`)
  }
  return lp.encode.single(payload, { maxDataLength: maxFrameBytes }).subarray()
}

function parseJson (body: Uint8Array, kind: string): unknown {
  try {
    return JSON.parse(utf8Strict.decode(body))
  } catch (err) {
    throw malformed(`${kind} body is not valid JSON`, err)
  }
}

/** Decodes one payload (the bytes inside a length prefix). */
export function decodePayload (payload: Uint8Array | Uint8ArrayList): InferFrame {
  const buf = payload instanceof Uint8Array ? payload : payload.subarray()
  if (buf.length < 3) throw new InferWireError('SHOAL_ERR_INFER_TRUNCATED', `frame of ${buf.length} bytes is shorter than its header`)
  if (buf[0] !== INFER_WIRE_VERSION) throw new InferWireError('SHOAL_ERR_INFER_UNSUPPORTED_VERSION', `frame version ${buf[0]} is not supported (this node speaks ${INFER_WIRE_VERSION})`)
  const kind = KIND_BY_CODE.get(buf[1] as number)
  if (kind === undefined) throw new InferWireError('SHOAL_ERR_INFER_UNKNOWN_KIND', `unknown frame kind ${buf[1]}`)
  const [idLen, o] = readVarint(buf, 2)
  if (idLen === 0 || idLen > MAX_REQUEST_ID_BYTES) throw malformed(`request id must be 1-${MAX_REQUEST_ID_BYTES} bytes`)
  if (o + idLen > buf.length) throw new InferWireError('SHOAL_ERR_INFER_TRUNCATED', 'frame ends inside its request id')
  let requestId: string
  try {
    requestId = utf8Strict.decode(buf.subarray(o, o + idLen))
  } catch (err) {
    throw malformed('request id is not valid UTF-8', err)
  }
  const body = buf.subarray(o + idLen)
  switch (kind) {
    case 'request': return { kind, requestId, request: decodeRequest(requestId, parseJson(body, kind)) }
    case 'start': return { kind, requestId, event: decodeStart(parseJson(body, kind)) }
    case 'delta': return { kind, requestId, event: decodeDelta(body) }
    case 'end': return { kind, requestId, event: decodeEnd(parseJson(body, kind)) }
    case 'error': return { kind, requestId, error: decodeError(parseJson(body, kind)) }
    case 'cancel':
      if (body.length !== 0) throw malformed('cancel frame has a body')
      return { kind, requestId }
  }
}

/** Maps it-length-prefixed's errors onto ours. */
export function lengthPrefixError (err: unknown): unknown {
  const code = (err as { code?: unknown } | null)?.code
  if (code === 'ERR_MSG_DATA_TOO_LONG' || code === 'ERR_MSG_LENGTH_TOO_LONG') {
    return new InferWireError('SHOAL_ERR_INFER_TOO_LARGE', 'incoming frame exceeds the size cap', { cause: err })
  }
  if (code === 'ERR_UNEXPECTED_EOF') return new InferWireError('SHOAL_ERR_INFER_TRUNCATED', 'stream ended inside a frame', { cause: err })
  if (code === 'ERR_INVALID_MSG_LENGTH') return malformed('invalid frame length', err)
  return err
}

/** Decodes a whole byte buffer of frames (tests, tools); a partial last frame is an error. */
export function decodeFrames (bytes: Uint8Array, maxFrameBytes: number = MAX_FRAME_BYTES): InferFrame[] {
  const out: InferFrame[] = []
  try {
    for (const payload of lp.decode([bytes], { maxDataLength: maxFrameBytes })) out.push(decodePayload(payload))
  } catch (err) {
    throw lengthPrefixError(err)
  }
  return out
}
