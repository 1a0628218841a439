/**
 * `/shoal/load/1.0.0`: live load over a direct, long-lived stream. The poller sends
 * `{"type":"req","id"}`, the owner of the load answers `{"type":"load","id","load":{…}}` (or an
 * error frame with the same id). One request in flight per stream, so the cost is bounded by the
 * poll interval; the round trip of each pair is the RTT the peer table reports.
 */
import { asObject, decodeErrorFrame, decodeJson, encodeJson, malformed, nonNeg, requestId } from './frame.ts'
import type { ErrorFrame } from './frame.ts'

export const LOAD_PROTOCOL = '/shoal/load/1.0.0'
export const LOAD_MAX_FRAME = 4 * 1024

/** What a node says about how busy it is right now. Every number is finite and ≥ 0. */
export interface LoadRecord {
  /** Requests waiting for a batch slot. */
  queueDepth: number
  /** Sequences currently decoding. */
  inFlight: number
  /** Aggregate decode rate the node delivers with one more sequence, tokens per second (0: unknown). */
  decodeTokPerSec: number
  /** KV cache room left, in tokens. */
  freeKvTokens: number
  /** What a new request would wait before its prefill starts, in ms. */
  expectedWaitMs: number
  /** Sequences the node's batcher runs at once (optional). */
  slots?: number
  /** False when the node refuses new work (queue full, draining); absent means accepting. */
  accepting?: boolean
  /**
   * Of `inFlight`, the requests the asking peer sent (optional; only in a reply to that peer). The
   * asker knows its own requests exactly and at once, so it swaps this share for its own count
   * instead of guessing which of its dispatches and finishes the report already saw.
   */
  fromYou?: number
  /**
   * KV prefixes the node keeps for reuse, as compact block hashes (16 hex digits; daemon/kv
   * PrefixCache.summary, scoped by manifest hash, layer range and dtype), at most
   * LOAD_MAX_PREFIXES (optional; absent when it keeps none). Lets routing send a conversation
   * where its history's KV already is.
   */
  prefixes?: string[]
  /**
   * The node's measured prefill rate, tokens per second (optional; absent: not measured): what a
   * kept prefix saves there, for prefix-aware routing. With several models, the slowest.
   */
  prefillTokPerSec?: number
}

/** Bound on `prefixes`: 64 × 19 bytes of JSON keeps a load frame well inside LOAD_MAX_FRAME. */
export const LOAD_MAX_PREFIXES = 64
const PREFIX_HASH = /^[0-9a-f]{16}$/

export const LOAD_FIELDS = ['queueDepth', 'inFlight', 'decodeTokPerSec', 'freeKvTokens', 'expectedWaitMs'] as const

export const IDLE_LOAD: Readonly<LoadRecord> = Object.freeze({ queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 })

export interface LoadRequestFrame {
  v: 1
  type: 'req'
  id: number
}

export interface LoadReplyFrame {
  v: 1
  type: 'load'
  id: number
  load: LoadRecord
}

export type LoadFrame = LoadRequestFrame | LoadReplyFrame | ErrorFrame

/** Copies exactly the known fields; unknown fields (a newer minor version) are ignored. */
export function parseLoadRecord (value: unknown): LoadRecord {
  const obj = asObject(value, 'load')
  const out: Partial<LoadRecord> = {}
  for (const key of LOAD_FIELDS) out[key] = nonNeg(obj[key], `load.${key}`)
  if (obj.slots !== undefined) out.slots = nonNeg(obj.slots, 'load.slots')
  if (obj.fromYou !== undefined) out.fromYou = nonNeg(obj.fromYou, 'load.fromYou')
  if (obj.prefillTokPerSec !== undefined) out.prefillTokPerSec = nonNeg(obj.prefillTokPerSec, 'load.prefillTokPerSec')
  if (obj.accepting !== undefined) {
    if (typeof obj.accepting !== 'boolean') throw malformed('load.accepting is not a boolean')
    out.accepting = obj.accepting
  }
  if (obj.prefixes !== undefined) {
    const p = obj.prefixes
    if (!Array.isArray(p) || p.length > LOAD_MAX_PREFIXES) throw malformed(`load.prefixes is not an array of at most ${LOAD_MAX_PREFIXES}`)
    if (!p.every(h => typeof h === 'string' && PREFIX_HASH.test(h))) throw malformed('load.prefixes holds something other than 16 lowercase hex digits')
    out.prefixes = [...p] as string[]
  }
  return out as LoadRecord
}

export function encodeLoadFrame (frame: LoadFrame): Uint8Array {
  return encodeJson(frame, LOAD_MAX_FRAME)
}

export function decodeLoadFrame (bytes: Uint8Array): LoadFrame {
  const obj = decodeJson(bytes, LOAD_MAX_FRAME)
  switch (obj.type) {
    case 'req':
      return { v: 1, type: 'req', id: requestId(obj.id) }
    case 'load':
      return { v: 1, type: 'load', id: requestId(obj.id), load: parseLoadRecord(obj.load) }
    case 'error':
      return decodeErrorFrame(obj)
    default:
      throw malformed(`unknown load frame type ${JSON.stringify(obj.type.slice(0, 32))}`)
  }
}
