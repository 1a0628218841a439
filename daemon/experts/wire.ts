/**
 * The /shoal/experts/2.0.0 wire format: a stage node that runs a MoE layer's attention and router
 * sends each expert holder the rows routed to its experts; the holder answers with each row's
 * weighted partial sum. Many steps are in flight on one long-lived stream per (stage, holder)
 * pair, matched by step id. Version 2 (1.0.0 had no request spans, finish or part): a compute
 * frame says which request each row belongs to, so a holder can sign a receipt part per request
 * (the rows of several requests share one step), and the stage asks for that part when the
 * request ends.
 *
 * A frame is an unsigned-varint length, then a payload (all integers little-endian):
 *   u8 version (2) | u8 kind | u8 n | n bytes model key (the manifest hash, UTF-8)
 *   | zero padding to a 4-byte boundary | u32 step | body
 * Bodies:
 *   compute  u32 layer | u32 rows | u32 width | u32 groups | u32 spans
 *            | groups × (u32 expert | u32 count)
 *            | Σcount × u32 row (per group, ascending, each < rows) | Σcount × f32 weight
 *            | spans × (u32 count | u32 id bytes) | the spans' request ids (UTF-8, 1-1024 bytes
 *            each) back to back, zero-padded to a 4-byte boundary
 *            | rows × width f32 (the hidden rows, post-attention-norm)
 *            Groups list distinct experts ascending; every row belongs to at least one group.
 *            Spans (request id, row count) cover the rows in order, each count > 0, summing to
 *            rows; zero spans: the rows are attributed to no request.
 *   partial  u32 rows | u32 width | rows × width f32: for each row of the compute frame, in its
 *            order, Σ weight · expert(row) over the groups that name it, added in group order
 *   error    JSON {name, code, message}: the step failed at the holder (step 0: the link)
 *   finish   JSON {requestId, sign}: the request ended at the stage; the holder drops what it
 *            kept for it and, when `sign` is true, answers with a part frame (same step)
 *   part     JSON {part?}: the holder's signed receipt part for the request (absent when it
 *            signs nothing: no key, or no rows of that request)
 * Everything after the model key is 4-byte aligned, so a decoder can view tensors in place.
 */
import type { SerializedError } from '../errors.ts'
import { joinParts, lengthPrefixed } from '../wire-bytes.ts'
import { ExpertWireError } from './errors.ts'

export const EXPERTS_PROTOCOL = '/shoal/experts/2.0.0'
export const EXPERTS_WIRE_VERSION = 2
/** 256 rows of an 8192-wide model are 8 MiB; a prefill chunk of a large model fits. */
export const MAX_FRAME_BYTES = 16 * 1024 * 1024
export const MAX_MODEL_KEY_BYTES = 255
const MAX_ERROR_MESSAGE_CHARS = 2048
/** A request id in a span, in UTF-8 bytes (the receipt ledger's bound on ids, in characters). */
export const MAX_REQUEST_ID_BYTES = 1024
/** A part frame's JSON: a signed part is well under 4 KiB even naming every expert of 64 layers. */
const MAX_PART_JSON_BYTES = 256 * 1024

const KIND_CODES = { compute: 1, partial: 2, error: 3, finish: 4, part: 5 } as const
export type ExpertFrameKind = keyof typeof KIND_CODES
const KIND_BY_CODE = new Map(Object.entries(KIND_CODES).map(([k, v]) => [v as number, k as ExpertFrameKind]))

export interface ExpertGroup {
  expert: number
  /** Indices into the frame's rows, ascending. */
  rows: number[]
  weights: number[]
}

/** Consecutive rows of one request (the ingress request id = the receipt id). */
export interface RequestSpan {
  id: string
  rows: number
}

export type ExpertFrame =
  | { kind: 'compute', model: string, step: number, layer: number, rows: number, width: number, groups: ExpertGroup[], spans?: RequestSpan[], data: Float32Array }
  | { kind: 'partial', model: string, step: number, rows: number, width: number, data: Float32Array }
  | { kind: 'error', model: string, step: number, error: SerializedError }
  | { kind: 'finish', model: string, step: number, requestId: string, sign: boolean }
  | { kind: 'part', model: string, step: number, part?: Record<string, unknown> }

if (new Uint8Array(Uint16Array.of(1).buffer)[0] !== 1) throw new Error('the experts wire format assumes a little-endian host')

const utf8 = new TextEncoder()
const utf8Strict = new TextDecoder('utf-8', { fatal: true })
const malformed = (message: string, cause?: unknown): ExpertWireError =>
  new ExpertWireError('SHOAL_ERR_EXPERTS_MALFORMED', message, cause === undefined ? undefined : { cause })
const truncated = (message: string): ExpertWireError => new ExpertWireError('SHOAL_ERR_EXPERTS_TRUNCATED', message)
const isU32 = (n: unknown): n is number => Number.isInteger(n) && (n as number) >= 0 && (n as number) < 2 ** 32



/** Header through the step id, with `extra` bytes of room after it; `at` is 4-byte aligned. */
function header (kind: ExpertFrameKind, model: string, step: number, extra: number): { out: Uint8Array, dv: DataView, at: number } {
  const key = utf8.encode(model)
  if (key.length === 0 || key.length > MAX_MODEL_KEY_BYTES) throw malformed(`model key must be 1-${MAX_MODEL_KEY_BYTES} bytes`)
  if (!isU32(step)) throw malformed('step must be a u32')
  const stepAt = align4(3 + key.length)
  const out = new Uint8Array(stepAt + 4 + extra)
  out[0] = EXPERTS_WIRE_VERSION
  out[1] = KIND_CODES[kind]
  out[2] = key.length
  out.set(key, 3)
  const dv = new DataView(out.buffer, out.byteOffset, out.byteLength)
  dv.setUint32(stepAt, step, true)
  return { out, dv, at: stepAt + 4 }
}

const align4 = (n: number): number => n + ((4 - (n % 4)) % 4)

function checkGroups (rows: number, groups: ExpertGroup[]): void {
  const seen = new Uint8Array(rows)
  let last = -1
  for (const g of groups) {
    if (!isU32(g.expert) || g.expert <= last) throw malformed('compute: group experts must be distinct u32s, ascending')
    last = g.expert
    if (g.rows.length === 0 || g.rows.length !== g.weights.length) throw malformed(`compute: expert ${g.expert} has ${g.rows.length} rows and ${g.weights.length} weights`)
    let prev = -1
    for (const r of g.rows) {
      if (!Number.isInteger(r) || r <= prev || r >= rows) throw malformed(`compute: expert ${g.expert} rows must be ascending indices below ${rows}`)
      prev = r
      seen[r] = 1
    }
    if (g.weights.some(w => !Number.isFinite(w))) throw malformed(`compute: expert ${g.expert} has a non-finite weight`)
  }
  if (seen.includes(0)) throw malformed('compute: a row belongs to no group')
}

function checkSpans (rows: number, spans: RequestSpan[]): Uint8Array[] {
  if (spans.length === 0) return []
  let total = 0
  const ids = spans.map(sp => {
    if (!Number.isInteger(sp.rows) || sp.rows <= 0) throw malformed('compute: a request span must hold at least one row')
    total += sp.rows
    const id = utf8.encode(sp.id)
    if (id.length === 0 || id.length > MAX_REQUEST_ID_BYTES) throw malformed(`compute: a request id must be 1-${MAX_REQUEST_ID_BYTES} bytes`)
    return id
  })
  if (total !== rows) throw malformed(`compute: request spans cover ${total} rows of ${rows}`)
  return ids
}

function jsonBody (v: unknown): Uint8Array {
  return utf8.encode(JSON.stringify(v))
}

function parseJson (buf: Uint8Array, what: string): Record<string, unknown> {
  let v: unknown
  try {
    v = JSON.parse(utf8Strict.decode(buf))
  } catch (err) {
    throw malformed(`${what} body is not valid JSON`, err)
  }
  if (v === null || typeof v !== 'object' || Array.isArray(v)) throw malformed(`${what} body is not an object`)
  return v as Record<string, unknown>
}

/** The payload as parts: tensor bytes are not copied (the last part is a view of `data`). */
export function encodePayloadParts (f: ExpertFrame): Uint8Array[] {
  switch (f.kind) {
    case 'compute': {
      if (!isU32(f.layer) || !isU32(f.rows) || !isU32(f.width) || f.rows === 0 || f.width === 0) throw malformed('compute: layer, rows and width must be u32, rows and width > 0')
      if (f.data.length !== f.rows * f.width) throw malformed(`compute: ${f.data.length} values for ${f.rows} × ${f.width}`)
      checkGroups(f.rows, f.groups)
      const spans = f.spans ?? []
      const ids = checkSpans(f.rows, spans)
      const total = f.groups.reduce((s, g) => s + g.rows.length, 0)
      const idBytes = align4(ids.reduce((n, id) => n + id.length, 0))
      const { out, dv, at } = header('compute', f.model, f.step, 20 + 8 * f.groups.length + 8 * total + 8 * spans.length + idBytes)
      dv.setUint32(at, f.layer, true)
      dv.setUint32(at + 4, f.rows, true)
      dv.setUint32(at + 8, f.width, true)
      dv.setUint32(at + 12, f.groups.length, true)
      dv.setUint32(at + 16, spans.length, true)
      let o = at + 20
      for (const g of f.groups) { dv.setUint32(o, g.expert, true); dv.setUint32(o + 4, g.rows.length, true); o += 8 }
      for (const g of f.groups) for (const r of g.rows) { dv.setUint32(o, r, true); o += 4 }
      for (const g of f.groups) for (const w of g.weights) { dv.setFloat32(o, w, true); o += 4 }
      spans.forEach((sp, i) => { dv.setUint32(o, sp.rows, true); dv.setUint32(o + 4, ids[i]!.length, true); o += 8 })
      for (const id of ids) { out.set(id, o); o += id.length }
      return [out, new Uint8Array(f.data.buffer, f.data.byteOffset, f.data.byteLength)]
    }
    case 'partial': {
      if (!isU32(f.rows) || !isU32(f.width) || f.rows === 0 || f.width === 0) throw malformed('partial: rows and width must be u32 > 0')
      if (f.data.length !== f.rows * f.width) throw malformed(`partial: ${f.data.length} values for ${f.rows} × ${f.width}`)
      const { out, dv, at } = header('partial', f.model, f.step, 8)
      dv.setUint32(at, f.rows, true)
      dv.setUint32(at + 4, f.width, true)
      return [out, new Uint8Array(f.data.buffer, f.data.byteOffset, f.data.byteLength)]
    }
    case 'error': {
      const body = utf8.encode(JSON.stringify({ name: f.error.name, code: f.error.code, message: f.error.message.slice(0, MAX_ERROR_MESSAGE_CHARS) }))
      const { out, at } = header('error', f.model, f.step, body.length)
      out.set(body, at)
      return [out]
    }
    case 'finish': {
      if (utf8.encode(f.requestId).length === 0 || utf8.encode(f.requestId).length > MAX_REQUEST_ID_BYTES) throw malformed(`finish: a request id must be 1-${MAX_REQUEST_ID_BYTES} bytes`)
      const body = jsonBody({ requestId: f.requestId, sign: f.sign })
      const { out, at } = header('finish', f.model, f.step, body.length)
      out.set(body, at)
      return [out]
    }
    case 'part': {
      const body = jsonBody(f.part === undefined ? {} : { part: f.part })
      if (body.length > MAX_PART_JSON_BYTES) throw malformed(`part: ${body.length} bytes of JSON exceed ${MAX_PART_JSON_BYTES}`)
      const { out, at } = header('part', f.model, f.step, body.length)
      out.set(body, at)
      return [out]
    }
  }
}

/** The frame as it goes on the stream: varint length, then the payload parts. */
export function encodeFrameParts (f: ExpertFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array[] {
  return lengthPrefixed(encodePayloadParts(f), maxFrameBytes, len => new ExpertWireError('SHOAL_ERR_EXPERTS_TOO_LARGE', `${f.kind} frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`))
}

/** The frame as one contiguous byte array (tests, golden bytes). */
export function encodeFrame (f: ExpertFrame, maxFrameBytes: number = MAX_FRAME_BYTES): Uint8Array {
  return joinParts(encodeFrameParts(f, maxFrameBytes))
}

/** The step id of a payload whose body may not decode (so an answer can be matched or refused). */
export function peekStep (buf: Uint8Array): number | undefined {
  const n = buf[2]
  if (n === undefined) return undefined
  const at = align4(3 + n)
  if (buf.length < at + 4) return undefined
  return new DataView(buf.buffer, buf.byteOffset, buf.byteLength).getUint32(at, true)
}

/** f32 values at byte offset `at` of `buf`: a view when aligned, else a copy. */
function f32At (buf: Uint8Array, at: number, count: number): Float32Array {
  const start = buf.byteOffset + at
  if (start % 4 === 0) return new Float32Array(buf.buffer, start, count)
  // Copy into a fresh buffer (a Node Buffer's slice() would be a view of its pool).
  const copy = new Uint8Array(count * 4)
  copy.set(buf.subarray(at, at + count * 4))
  return new Float32Array(copy.buffer)
}

/** Decodes one payload (the bytes inside a length prefix). */
export function decodePayload (buf: Uint8Array): ExpertFrame {
  if (buf.length < 3) throw truncated(`frame of ${buf.length} bytes is shorter than its header`)
  if (buf[0] !== EXPERTS_WIRE_VERSION) throw new ExpertWireError('SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION', `experts frame version ${buf[0]} is not supported (this node speaks ${EXPERTS_WIRE_VERSION})`)
  const kind = KIND_BY_CODE.get(buf[1] as number)
  if (kind === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_UNKNOWN_KIND', `unknown experts frame kind ${buf[1]}`)
  const keyLen = buf[2] as number
  if (keyLen === 0) throw malformed('model key is empty')
  const stepAt = align4(3 + keyLen)
  if (buf.length < stepAt + 4) throw truncated('frame ends inside its header')
  let model: string
  try {
    model = utf8Strict.decode(buf.subarray(3, 3 + keyLen))
  } catch (err) {
    throw malformed('model key is not valid UTF-8', err)
  }
  if (buf.subarray(3 + keyLen, stepAt).some(b => b !== 0)) throw malformed('header padding is not zero')
  const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength)
  const step = dv.getUint32(stepAt, true)
  const at = stepAt + 4
  switch (kind) {
    case 'compute': {
      if (buf.length < at + 20) throw truncated('compute: frame ends inside its header')
      const layer = dv.getUint32(at, true)
      const rows = dv.getUint32(at + 4, true)
      const width = dv.getUint32(at + 8, true)
      const n = dv.getUint32(at + 12, true)
      const nSpans = dv.getUint32(at + 16, true)
      if (rows === 0 || width === 0) throw malformed('compute: rows and width must be > 0')
      if (buf.length < at + 20 + 8 * n) throw truncated('compute: frame ends inside its group table')
      const counts: Array<[number, number]> = []
      let total = 0
      for (let g = 0; g < n; g++) {
        const c = dv.getUint32(at + 20 + 8 * g + 4, true)
        counts.push([dv.getUint32(at + 20 + 8 * g, true), c])
        total += c
      }
      const idxAt = at + 20 + 8 * n
      const spanAt = idxAt + 8 * total
      if (buf.length < spanAt + 8 * nSpans) throw truncated('compute: frame ends inside its span table')
      const spanTable: Array<[number, number]> = []
      let idTotal = 0
      for (let i = 0; i < nSpans; i++) {
        const len = dv.getUint32(spanAt + 8 * i + 4, true)
        spanTable.push([dv.getUint32(spanAt + 8 * i, true), len])
        idTotal += len
      }
      const idsAt = spanAt + 8 * nSpans
      const dataAt = align4(idsAt + idTotal)
      const expected = dataAt + rows * width * 4
      if (buf.length < expected) throw truncated(`compute: ${buf.length} bytes, ${expected} expected`)
      if (buf.length > expected) throw malformed(`compute: ${buf.length - expected} bytes after the rows`)
      let o = 0
      const groups: ExpertGroup[] = counts.map(([expert, c]) => {
        const g: ExpertGroup = { expert, rows: [], weights: [] }
        for (let j = 0; j < c; j++, o++) {
          g.rows.push(dv.getUint32(idxAt + 4 * o, true))
          g.weights.push(dv.getFloat32(idxAt + 4 * total + 4 * o, true))
        }
        return g
      })
      checkGroups(rows, groups)
      if (buf.subarray(idsAt + idTotal, dataAt).some(b => b !== 0)) throw malformed('compute: request id padding is not zero')
      let idAt = idsAt
      const spans: RequestSpan[] = spanTable.map(([count, len]) => {
        let id: string
        try {
          id = utf8Strict.decode(buf.subarray(idAt, idAt + len))
        } catch (err) {
          throw malformed('compute: a request id is not valid UTF-8', err)
        }
        idAt += len
        return { id, rows: count }
      })
      checkSpans(rows, spans)
      return { kind, model, step, layer, rows, width, groups, ...(spans.length === 0 ? {} : { spans }), data: f32At(buf, dataAt, rows * width) }
    }
    case 'partial': {
      if (buf.length < at + 8) throw truncated('partial: frame ends inside its header')
      const rows = dv.getUint32(at, true)
      const width = dv.getUint32(at + 4, true)
      if (rows === 0 || width === 0) throw malformed('partial: rows and width must be > 0')
      const expected = at + 8 + rows * width * 4
      if (buf.length !== expected) throw (buf.length < expected ? truncated : malformed)(`partial: ${buf.length} bytes, ${expected} expected`)
      return { kind, model, step, rows, width, data: f32At(buf, at + 8, rows * width) }
    }
    case 'error': {
      const o = parseJson(buf.subarray(at), 'error')
      if (typeof o.name !== 'string' || typeof o.code !== 'string' || typeof o.message !== 'string') throw malformed('error body is malformed')
      return { kind, model, step, error: { name: o.name, code: o.code, message: o.message } }
    }
    case 'finish': {
      const o = parseJson(buf.subarray(at), 'finish')
      if (typeof o.requestId !== 'string' || o.requestId.length === 0 || utf8.encode(o.requestId).length > MAX_REQUEST_ID_BYTES || typeof o.sign !== 'boolean') throw malformed('finish body must be {requestId, sign}')
      return { kind, model, step, requestId: o.requestId, sign: o.sign }
    }
    case 'part': {
      if (buf.length - at > MAX_PART_JSON_BYTES) throw malformed(`part: more than ${MAX_PART_JSON_BYTES} bytes of JSON`)
      const o = parseJson(buf.subarray(at), 'part')
      const part = o.part
      if (part !== undefined && (part === null || typeof part !== 'object' || Array.isArray(part))) throw malformed('part body must be {part?: object}')
      return { kind, model, step, ...(part === undefined ? {} : { part: part as Record<string, unknown> }) }
    }
  }
}
