/**
 * Receipt and receipt-part bodies: their shapes, how their hashes are computed, and the pure
 * builder that turns a finished request into a receipt input. Nothing here touches disk, so an
 * executor (stage worker, forwarding peer) can use it without a ledger.
 */
import { createHash } from 'node:crypto'
import { canonicalBytes, signDocument, verifyDocument } from '../../certs/signed.ts'
import type { SignedDocument } from '../../certs/signed.ts'
import type { ClientIdentity, GenerateRequest, FinishReason, PrefixReuse, Usage } from '../service.ts'

export const RECEIPT_FORMAT = 'shoal.receipt/1'
export const RECEIPT_PART_FORMAT = 'shoal.receipt-part/1'
/** `prevHash` of entry 0: there is no previous entry. */
export const GENESIS_HASH = '0'.repeat(64)

/** Inclusive global layer range [first, last], as in the shard manifest. */
export type LayerRange = [number, number]

/** One executing node in request order. `layers` is absent for a node that ran the whole model. */
export interface RouteHop {
  peerId: string
  layers?: LayerRange
}

/** What one executing node signs about its share of a request. */
export interface ReceiptPartBody {
  format: typeof RECEIPT_PART_FORMAT
  /** The ingress request id (= the receipt id): binds the part to one receipt. */
  requestId: string
  peerId: string
  model: string
  /** null when the node ran the whole model. */
  layers: LayerRange | null
  /** sha256 (lowercase hex) over the bytes the node received and produced for this request. */
  inputHash: string
  outputHash: string
  /** Tokens the node consumed as input (prompt + fed-back tokens) and tokens/positions it produced. */
  tokens: { input: number, output: number }
  /** Epoch milliseconds when the node began, and how long its share took. */
  timing: { startedAt: number, durationMs: number }
  /**
   * An expert holder's share of a mixture-of-experts model: the experts it ran for the request,
   * per MoE layer (layers ascending, experts ascending and distinct). Absent for every other node.
   */
  experts?: ExpertsServed[]
}

/** The experts of one MoE layer a holder ran for a request. */
export interface ExpertsServed {
  layer: number
  experts: number[]
}

/** Bounds on a part's `experts` (a 64-layer model with 256 experts per layer fits). */
export const MAX_PART_EXPERT_LAYERS = 1024
export const MAX_PART_EXPERTS_PER_LAYER = 4096

export type SignedReceiptPart = SignedDocument<ReceiptPartBody>

/** Everything a receipt states about a completion; the ledger adds position, signer and time. */
export interface ReceiptInput {
  /** The request id; unique within a log. */
  id: string
  /** sha256 hex over JCS of the request's semantic content (see `requestContent`). */
  requestHash: string
  /** sha256 hex over JCS of {text, tokenIds, finishReason} (see `responseContent`). */
  responseHash: string
  model: { id: string, manifestHash: string | null }
  route: RouteHop[]
  /** Signed parts of the other executing nodes (pipeline stages, forward targets). */
  parts: SignedReceiptPart[]
  usage: Usage
  /** Epoch ms of arrival; ms to first token (null when none was produced); total ms. */
  timing: { startedAt: number, firstTokenMs: number | null, totalMs: number }
  finishReason: FinishReason
  /** The client API key that asked (name and serial), when the ingress requires keys; absent otherwise. */
  client?: ClientIdentity
  /** What speculative decoding did (the drafter, tokens it proposed and the model accepted); absent without it. */
  speculation?: { drafter: string, drafted: number, accepted: number }
  /**
   * Prompt tokens the executing node took from its KV prefix cache instead of prefilling them
   * (`movedFrom`: the peer whose cache they were pulled from first); absent when none.
   */
  prefix?: PrefixReuse
}

/** The signed body of a log entry. */
export interface ReceiptBody extends ReceiptInput {
  format: typeof RECEIPT_FORMAT
  /** Position in the signer's log, from 0. */
  index: number
  /** Peer id of the node whose log this is and who signed. */
  signer: string
  /** Epoch milliseconds when the entry was appended. */
  timestamp: number
  /** sha256 hex of JCS(entry index-1), or GENESIS_HASH for index 0. */
  prevHash: string
}

export type SignedReceipt = SignedDocument<ReceiptBody>

export function sha256Hex (bytes: Uint8Array): string {
  return createHash('sha256').update(bytes).digest('hex')
}

/** sha256 hex over the JCS bytes of a JSON value. */
export function hashJson (value: unknown): string {
  return sha256Hex(canonicalBytes(value))
}

/** The hash that chains entries: sha256 hex over JCS of the whole signed entry {body, signature}. */
export function entryHash (entry: SignedReceipt): string {
  return hashJson({ body: entry.body, signature: entry.signature })
}

export type RequestLike = Pick<GenerateRequest, 'model' | 'prompt' | 'sampling' | 'stop' | 'maxTokens'>

/**
 * The request's semantic content: what was asked, without transport details (id, deadline).
 * Optional fields are written out explicitly so absent and undefined hash the same.
 */
export function requestContent (request: RequestLike): unknown {
  const p = request.prompt
  const prompt = p.kind === 'chat'
    ? { kind: 'chat', messages: p.messages.map((m) => m.name === undefined ? { role: m.role, content: m.content } : { role: m.role, content: m.content, name: m.name }) }
    : p.kind === 'text'
      ? { kind: 'text', text: p.text }
      : { kind: 'tokens', ids: [...p.ids] }
  const sampling: Record<string, number> = { temperature: request.sampling.temperature, topP: request.sampling.topP }
  if (request.sampling.seed !== undefined) sampling.seed = request.sampling.seed
  return { model: request.model, prompt, sampling, stop: [...request.stop], maxTokens: request.maxTokens ?? null }
}

export interface CompletionOutput {
  text: string
  tokenIds: number[]
  finishReason: FinishReason
}

export function responseContent (output: CompletionOutput): unknown {
  return { text: output.text, tokenIds: [...output.tokenIds], finishReason: output.finishReason }
}

export function requestHash (request: RequestLike): string {
  return hashJson(requestContent(request))
}

export function responseHash (output: CompletionOutput): string {
  return hashJson(responseContent(output))
}

export interface ReceiptContext {
  manifestHash?: string | null
  speculation?: { drafter: string, drafted: number, accepted: number }
  prefix?: PrefixReuse
  route: RouteHop[]
  parts?: SignedReceiptPart[]
  usage: Usage
  timing: { startedAt: number, firstTokenMs: number | null, totalMs: number }
}

/** Pure: the receipt input for a finished request and its complete output. */
export function buildReceiptInput (request: RequestLike & { requestId: string, client?: ClientIdentity }, output: CompletionOutput, context: ReceiptContext): ReceiptInput {
  const input: ReceiptInput = {
    id: request.requestId,
    requestHash: requestHash(request),
    responseHash: responseHash(output),
    model: { id: request.model, manifestHash: context.manifestHash ?? null },
    route: context.route.map((h) => h.layers === undefined ? { peerId: h.peerId } : { peerId: h.peerId, layers: [h.layers[0], h.layers[1]] }),
    parts: [...(context.parts ?? [])],
    usage: { promptTokens: context.usage.promptTokens, completionTokens: context.usage.completionTokens },
    timing: { ...context.timing },
    finishReason: output.finishReason,
  }
  if (request.client !== undefined) input.client = { name: request.client.name, serial: request.client.serial }
  const s = context.speculation
  if (s !== undefined) input.speculation = { drafter: s.drafter, drafted: s.drafted, accepted: s.accepted }
  const p = context.prefix
  if (p !== undefined && p.reusedTokens > 0) input.prefix = { peerId: p.peerId, reusedTokens: p.reusedTokens, ...(p.movedFrom === undefined ? {} : { movedFrom: p.movedFrom }) }
  return input
}

export type ReceiptPartInput = Omit<ReceiptPartBody, 'format'>

/** Signs an executor's part with its raw 32-byte ed25519 seed. Throws on a malformed input. */
export function createReceiptPart (input: ReceiptPartInput, secretKey: Uint8Array): SignedReceiptPart {
  const body: ReceiptPartBody = {
    format: RECEIPT_PART_FORMAT,
    requestId: input.requestId,
    peerId: input.peerId,
    model: input.model,
    layers: input.layers === null ? null : [input.layers[0], input.layers[1]],
    inputHash: input.inputHash,
    outputHash: input.outputHash,
    tokens: { input: input.tokens.input, output: input.tokens.output },
    timing: { startedAt: input.timing.startedAt, durationMs: input.timing.durationMs },
  }
  // Copied field by field (like the rest), so a caller's extra keys never reach the signature.
  if (input.experts !== undefined) body.experts = input.experts.map(e => ({ layer: e.layer, experts: [...e.experts] }))
  const problem = checkPartBody(body)
  if (problem !== undefined) throw new TypeError(`receipt part: ${problem}`)
  return signDocument(body, secretKey)
}

/**
 * True when the part is well formed and signed by `publicKey` (raw 32 bytes). Exactly `{body,
 * signature}`: a field beside them is not signed, and the ledger refuses to store it — a part that
 * verified here with one would make the whole receipt's append fail after the completion ran.
 */
export function verifyReceiptPart (part: unknown, publicKey: Uint8Array): boolean {
  if (!isRecord(part) || onlyKeys(part, ['body', 'signature']) !== undefined || checkPartBody(part.body) !== undefined) return false
  return verifyDocument(part as unknown as SignedReceiptPart, publicKey)
}

// ---- shape checks: return a description of the first problem, or undefined ----

const HEX64 = /^[0-9a-f]{64}$/
const HEX32 = /^[0-9a-f]{32}$/

function isRecord (v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v)
}
function isCount (v: unknown): v is number {
  return typeof v === 'number' && Number.isSafeInteger(v) && v >= 0
}
function isTime (v: unknown): v is number {
  return typeof v === 'number' && Number.isFinite(v) && v >= 0
}
function isText (v: unknown): v is string {
  return typeof v === 'string' && v.length > 0 && v.length <= 1024
}
function isLayers (v: unknown): v is LayerRange {
  return Array.isArray(v) && v.length === 2 && isCount(v[0]) && isCount(v[1]) && v[0] <= v[1]
}
function onlyKeys (o: Record<string, unknown>, allowed: string[]): string | undefined {
  for (const k of Object.keys(o)) if (!allowed.includes(k)) return `unexpected field ${k}`
  return undefined
}

export function checkPartBody (b: unknown): string | undefined {
  if (!isRecord(b)) return 'body is not an object'
  if (b.format !== RECEIPT_PART_FORMAT) return `format is not ${RECEIPT_PART_FORMAT}`
  const extra = onlyKeys(b, ['format', 'requestId', 'peerId', 'model', 'layers', 'inputHash', 'outputHash', 'tokens', 'timing', 'experts'])
  if (extra !== undefined) return extra
  if (!isText(b.requestId)) return 'requestId'
  if (!isText(b.peerId)) return 'peerId'
  if (!isText(b.model)) return 'model'
  if (b.layers !== null && !isLayers(b.layers)) return 'layers'
  if (typeof b.inputHash !== 'string' || !HEX64.test(b.inputHash)) return 'inputHash'
  if (typeof b.outputHash !== 'string' || !HEX64.test(b.outputHash)) return 'outputHash'
  if (!isRecord(b.tokens) || !isCount(b.tokens.input) || !isCount(b.tokens.output)) return 'tokens'
  if (!isRecord(b.timing) || !isTime(b.timing.startedAt) || !isTime(b.timing.durationMs)) return 'timing'
  if (b.experts !== undefined && !isExpertsServed(b.experts)) return 'experts'
  return undefined
}

/** [{layer, experts}]: non-empty, layers strictly ascending, each layer's experts non-empty, strictly ascending. */
function isExpertsServed (v: unknown): boolean {
  if (!Array.isArray(v) || v.length === 0 || v.length > MAX_PART_EXPERT_LAYERS) return false
  let lastLayer = -1
  for (const e of v) {
    if (!isRecord(e) || onlyKeys(e, ['layer', 'experts']) !== undefined || !isCount(e.layer) || e.layer <= lastLayer) return false
    lastLayer = e.layer
    const xs = e.experts
    if (!Array.isArray(xs) || xs.length === 0 || xs.length > MAX_PART_EXPERTS_PER_LAYER) return false
    let last = -1
    for (const x of xs) {
      if (!isCount(x) || x <= last) return false
      last = x
    }
  }
  return true
}

/** Checks the fields a caller supplies (ReceiptInput). */
export function checkReceiptInput (r: unknown): string | undefined {
  if (!isRecord(r)) return 'receipt is not an object'
  if (!isText(r.id)) return 'id must be a non-empty string of at most 1024 characters'
  if (typeof r.requestHash !== 'string' || !HEX64.test(r.requestHash)) return 'requestHash must be 64 lowercase hex digits'
  if (typeof r.responseHash !== 'string' || !HEX64.test(r.responseHash)) return 'responseHash must be 64 lowercase hex digits'
  const m = r.model
  if (!isRecord(m) || !isText(m.id) || (m.manifestHash !== null && (typeof m.manifestHash !== 'string' || !HEX64.test(m.manifestHash)))) return 'model must be {id, manifestHash: hex64 | null}'
  if (onlyKeys(m, ['id', 'manifestHash']) !== undefined) return 'model has unexpected fields'
  if (!Array.isArray(r.route) || r.route.length > 256) return 'route must be an array'
  for (const h of r.route) {
    if (!isRecord(h) || !isText(h.peerId) || (h.layers !== undefined && !isLayers(h.layers)) || onlyKeys(h, ['peerId', 'layers']) !== undefined) return 'route hop must be {peerId, layers?: [first, last]}'
  }
  if (!Array.isArray(r.parts) || r.parts.length > 256) return 'parts must be an array'
  for (const p of r.parts) {
    if (!isRecord(p) || typeof p.signature !== 'string' || onlyKeys(p, ['body', 'signature']) !== undefined) return 'part must be {body, signature}'
    const problem = checkPartBody(p.body)
    if (problem !== undefined) return `part: ${problem}`
    if ((p.body as ReceiptPartBody).requestId !== r.id) return 'part requestId differs from the receipt id'
  }
  const u = r.usage
  if (!isRecord(u) || !isCount(u.promptTokens) || !isCount(u.completionTokens) || onlyKeys(u, ['promptTokens', 'completionTokens']) !== undefined) return 'usage must be {promptTokens, completionTokens}'
  const t = r.timing
  if (!isRecord(t) || !isTime(t.startedAt) || !(t.firstTokenMs === null || isTime(t.firstTokenMs)) || !isTime(t.totalMs) || onlyKeys(t, ['startedAt', 'firstTokenMs', 'totalMs']) !== undefined) return 'timing must be {startedAt, firstTokenMs, totalMs}'
  if (!isText(r.finishReason)) return 'finishReason'
  const c = r.client
  if (c !== undefined && (!isRecord(c) || !isText(c.name) || typeof c.serial !== 'string' || !HEX32.test(c.serial) || onlyKeys(c, ['name', 'serial']) !== undefined)) return 'client must be {name, serial: 32 hex digits}'
  const s = r.speculation
  if (s !== undefined && (!isRecord(s) || !isText(s.drafter) || !isCount(s.drafted) || !isCount(s.accepted) || (s.accepted as number) > (s.drafted as number) || onlyKeys(s, ['drafter', 'drafted', 'accepted']) !== undefined)) return 'speculation must be {drafter, drafted, accepted ≤ drafted}'
  const px = r.prefix
  if (px !== undefined && (!isRecord(px) || !isText(px.peerId) || !isCount(px.reusedTokens) || (px.reusedTokens as number) === 0 || (px.movedFrom !== undefined && !isText(px.movedFrom)) || onlyKeys(px, ['peerId', 'reusedTokens', 'movedFrom']) !== undefined)) return 'prefix must be {peerId, reusedTokens > 0, movedFrom?}'
  return undefined
}

const BODY_FIELDS = ['format', 'index', 'signer', 'timestamp', 'prevHash', 'id', 'requestHash', 'responseHash', 'model', 'route', 'parts', 'usage', 'timing', 'finishReason', 'client', 'speculation', 'prefix']

/** Checks a whole stored entry: {body: ReceiptBody, signature}. */
export function checkEntry (e: unknown): string | undefined {
  if (!isRecord(e) || onlyKeys(e, ['body', 'signature']) !== undefined || typeof e.signature !== 'string') return 'entry is not {body, signature}'
  const b = e.body
  if (!isRecord(b)) return 'body is not an object'
  if (b.format !== RECEIPT_FORMAT) return `format is not ${RECEIPT_FORMAT}`
  const extra = onlyKeys(b, BODY_FIELDS)
  if (extra !== undefined) return extra
  if (!isCount(b.index)) return 'index'
  if (!isText(b.signer)) return 'signer'
  if (!isTime(b.timestamp)) return 'timestamp'
  if (typeof b.prevHash !== 'string' || !HEX64.test(b.prevHash)) return 'prevHash'
  return checkReceiptInput(b)
}
