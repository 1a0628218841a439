/**
 * Signed log heads (`shoal.log-head/1`): a node's statement "my receipt log held `count` entries,
 * the last of which hashes to `hash`", signed with its node key in the one scheme (JCS + ed25519).
 * Nodes sign theirs periodically and hand them to their peers, who keep the latest per signer
 * (witnessed heads). A log that was cut back and had its head pointer rewritten is then caught
 * by `verifyLog(db, { witnessedHeads })`: a witness saw more entries, or another hash at an index,
 * than the log now holds (as Certificate Transparency's signed tree heads catch a shrunk log).
 *
 * Also the witness store's file form (`shoal.witnessed-heads/1`, DATA/witnessed-heads.json) and the
 * pure decision whether a received head replaces the one held. Byte-level format: ./README.md.
 */
import { signDocument, verifyDocument } from '../../certs/signed.ts'
import type { SignedDocument } from '../../certs/signed.ts'
import { GENESIS_HASH } from './receipt.ts'

export const LOG_HEAD_FORMAT = 'shoal.log-head/1'
export const WITNESSED_HEADS_FORMAT = 'shoal.witnessed-heads/1'
/** A signed head is a few hundred bytes; anything larger is not one. */
export const MAX_HEAD_BYTES = 1024
/** Signers a witness file keeps (a fleet's nodes); more is refused, so a file cannot be grown without bound. */
export const MAX_WITNESSED_SIGNERS = 4096

export interface LogHeadBody {
  format: typeof LOG_HEAD_FORMAT
  /** Peer id of the node whose log this is (and who signs). */
  signer: string
  /** Entries in the log: the next append's index. */
  count: number
  /** sha256 hex of the whole signed entry count-1 (GENESIS_HASH when count is 0): the next entry's prevHash. */
  hash: string
  /** Epoch milliseconds when the node signed it (its clock). */
  timestamp: number
}

export type SignedLogHead = SignedDocument<LogHeadBody>

const HEX64 = /^[0-9a-f]{64}$/
const SIGNATURE = /^[A-Za-z0-9_-]{86}$/

export function createLogHead (head: { signer: string, count: number, hash: string, timestamp: number }, secretKey: Uint8Array): SignedLogHead {
  const body: LogHeadBody = { format: LOG_HEAD_FORMAT, signer: head.signer, count: head.count, hash: head.hash, timestamp: head.timestamp }
  const problem = checkHeadBody(body)
  if (problem !== undefined) throw new TypeError(`log head: ${problem}`)
  return signDocument(body, secretKey)
}

/** The first problem with a head body, or undefined. Exactly the five fields; a zero count has the genesis hash. */
export function checkHeadBody (b: unknown): string | undefined {
  if (typeof b !== 'object' || b === null || Array.isArray(b)) return 'body is not an object'
  const o = b as Record<string, unknown>
  if (o.format !== LOG_HEAD_FORMAT) return `format is not ${LOG_HEAD_FORMAT}`
  for (const k of Object.keys(o)) if (!['format', 'signer', 'count', 'hash', 'timestamp'].includes(k)) return `unexpected field ${k.slice(0, 64)}`
  if (typeof o.signer !== 'string' || o.signer.length === 0 || o.signer.length > 128) return 'signer'
  if (typeof o.count !== 'number' || !Number.isSafeInteger(o.count) || o.count < 0) return 'count'
  if (typeof o.hash !== 'string' || !HEX64.test(o.hash)) return 'hash'
  if (o.count === 0 && o.hash !== GENESIS_HASH) return 'hash of an empty log must be the genesis hash'
  if (typeof o.timestamp !== 'number' || !Number.isSafeInteger(o.timestamp) || o.timestamp < 0) return 'timestamp'
  return undefined
}

/** A well-formed signed head (shape only; the signature is checked by `verifyLogHead`), or why not. */
export function parseLogHead (doc: unknown): { ok: true, head: SignedLogHead } | { ok: false, detail: string } {
  if (typeof doc !== 'object' || doc === null || Array.isArray(doc)) return { ok: false, detail: 'not an object' }
  const d = doc as Record<string, unknown>
  if (Object.keys(d).some(k => k !== 'body' && k !== 'signature')) return { ok: false, detail: 'not {body, signature}' }
  if (typeof d.signature !== 'string' || !SIGNATURE.test(d.signature)) return { ok: false, detail: 'signature is not 86 base64url characters' }
  const problem = checkHeadBody(d.body)
  if (problem !== undefined) return { ok: false, detail: problem }
  const b = d.body as LogHeadBody
  return { ok: true, head: { body: { format: LOG_HEAD_FORMAT, signer: b.signer, count: b.count, hash: b.hash, timestamp: b.timestamp }, signature: d.signature } }
}

export function verifyLogHead (head: SignedLogHead, publicKey: Uint8Array): boolean {
  return verifyDocument(head, publicKey)
}

/**
 * Whether a witness should keep `offered` instead of `held` (both verified, same signer): a head
 * with more entries, or as many and signed later. One with fewer entries than the held one is
 * never taken: that is what a truncated log looks like ('shrunk', worth a warning).
 */
export function chooseHead (held: LogHeadBody | undefined, offered: LogHeadBody): 'take' | 'keep' | 'shrunk' | 'forked' {
  if (held === undefined) return 'take'
  if (offered.count < held.count) return 'shrunk'
  if (offered.count === held.count && offered.hash !== held.hash) return 'forked'
  if (offered.count > held.count || offered.timestamp > held.timestamp) return 'take'
  return 'keep'
}

export interface WitnessedHeadsFile {
  format: typeof WITNESSED_HEADS_FORMAT
  /** The latest head seen per signer, by peer id. */
  heads: Record<string, SignedLogHead>
}

/** Heads from a witness file (or a bare array of signed heads), shape-checked; problems are listed, not thrown. */
export function headsFromFile (doc: unknown): { heads: SignedLogHead[], malformed: number } {
  let candidates: unknown[]
  if (Array.isArray(doc)) candidates = doc
  else if (typeof doc === 'object' && doc !== null && (doc as { format?: unknown }).format === WITNESSED_HEADS_FORMAT &&
    typeof (doc as { heads?: unknown }).heads === 'object' && (doc as { heads?: unknown }).heads !== null) {
    candidates = Object.values((doc as { heads: Record<string, unknown> }).heads)
  } else if (typeof doc === 'object' && doc !== null && 'body' in doc) candidates = [doc]
  else return { heads: [], malformed: 1 }
  const heads: SignedLogHead[] = []
  let malformed = 0
  for (const c of candidates.slice(0, MAX_WITNESSED_SIGNERS)) {
    const parsed = parseLogHead(c)
    if (parsed.ok) heads.push(parsed.head)
    else malformed++
  }
  return { heads, malformed: malformed + Math.max(0, candidates.length - MAX_WITNESSED_SIGNERS) }
}
