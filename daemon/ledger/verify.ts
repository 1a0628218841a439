/**
 * Walks a receipt log from entry 0 and reports the first entry that breaks it: a gap, a body that
 * is not a receipt, a wrong position, a broken hash link, an unknown signer, a bad signature, a bad
 * embedded part, a missing id mapping, or a head pointer that disagrees with the last entry — and,
 * given the operator's CA, a signer that CA did not vouch for. Reads one snapshot, so it is safe
 * while the ledger appends.
 */
import { verifyDocument } from '../../certs/signed.ts'
import type { CaCertificate } from '../../certs/index.ts'
import { createCaTrust, resolveKey } from './keys.ts'
import { checkEntry, entryHash, GENESIS_HASH, verifyReceiptPart } from './receipt.ts'
import { verifyLogHead } from './head.ts'
import type { SignedLogHead } from './head.ts'
import type { ReceiptBody, SignedReceipt } from './receipt.ts'
import { ENTRY_RANGE, KEY, parseEntry, parseEntryKey, parseHead, readCertificates } from './store.ts'
import type { LedgerDb } from './store.ts'

export const VERIFY_REASONS = [
  /** No entry at this index although later ones exist (or the head points past the end). */
  'missing-entry',
  /** Not JSON, or not a well-formed receipt entry. */
  'malformed',
  /** body.index differs from the entry's position (moved or reordered). */
  'index-mismatch',
  /** body.prevHash is not the hash of the entry before. */
  'chain-broken',
  /** No public key for body.signer: the log stores certificates but not this signer's, or it stores none and the peer id embeds no key. */
  'unknown-signer',
  /** The stored certificate does not belong to body.signer. */
  'certificate-mismatch',
  /** The entry's signature does not verify with the signer's key. */
  'bad-signature',
  /** An embedded receipt part has an unknown signer or a bad signature. */
  'bad-part',
  /** The id → index mapping for this entry is missing or points elsewhere. */
  'id-mapping',
  /** The head pointer is missing or differs from the last entry (e.g. the tail was cut). */
  'head-mismatch',
  /**
   * Only with `options.ca`: the entry's signer or an embedded part's signer has no stored
   * certificate that this CA issued and signed, for that peer id and key, valid at the entry's
   * `timestamp` (CLOCK_SKEW_MS either side). Revocation is not checked.
   */
  'untrusted-signer',
  /**
   * Only with `options.witnessedHeads`: a head the log's signer signed (and a peer kept) says the
   * log held more entries than it does now (a cut tail, the head pointer rewritten to match), or
   * that the entry at its last index hashed to something else (the log was rewritten).
   */
  'witnessed-head',
] as const

export type VerifyReason = typeof VERIFY_REASONS[number]

export interface VerifyOptions {
  /** Overrides the stored certificate / peer id as the source of a signer's key. */
  publicKeyFor?: (peerId: string) => Uint8Array | undefined
  /**
   * The operator's CA certificate: every entry signer and every part signer must then hold a stored
   * certificate from it, valid at the entry's `timestamp` (else 'untrusted-signer'). Without it the
   * walk proves only that the log is internally consistent. Throws CertificateError if it is not a
   * valid CA certificate.
   */
  ca?: CaCertificate
  /**
   * Signed log heads peers kept (their DATA/witnessed-heads.json, see head.ts): each one signed by
   * the signer of this log's entries must match it — the log must reach its count, and the entry at
   * count-1 must hash to its hash — else 'witnessed-head'. Heads of other signers are not this
   * log's and are skipped; heads whose signature does not verify are counted and skipped.
   */
  witnessedHeads?: readonly SignedLogHead[]
  signal?: AbortSignal
}

export interface VerifyReport {
  ok: boolean
  /** Entries checked and found good before the first bad one (all of them when ok). */
  entries: number
  /** Hash of the last good entry (GENESIS_HASH for an empty log). */
  headHash: string
  /** Peer ids that signed the good entries, in order of first appearance, and whether the log holds their certificate. */
  signers: Array<{ peerId: string, certificate: boolean }>
  /** Peer ids that signed embedded parts of the good entries, in order of first appearance. */
  partSigners: string[]
  /** With `options.ca`: the CA every signer of the good entries chains to. */
  ca?: { name: string, keyId: string }
  /** With `options.witnessedHeads`: heads of this log's signers checked (`applied`), and heads skipped because their signature did not verify. */
  witness?: { applied: number, badSignature: number, newest?: { count: number, hash: string, timestamp: number } }
  firstBad?: { index: number, id?: string, reason: VerifyReason, detail: string }
}

export async function verifyLog (db: LedgerDb, options: VerifyOptions = {}): Promise<VerifyReport> {
  const trust = options.ca === undefined ? undefined : createCaTrust(options.ca) // throws before any work for a bad CA
  const ca = options.ca === undefined ? undefined : { name: options.ca.body.name, keyId: options.ca.body.keyId }
  const snapshot = db.snapshot()
  try {
    const certs = await readCertificates(db, snapshot)
    const head = await db.get(KEY.head, { snapshot })
    let expected = 0
    let prevHash = GENESIS_HASH
    let lastId: string | undefined
    const signers: VerifyReport['signers'] = []
    const partSigners: string[] = []
    // Witnessed heads by the index of the entry they end at (count - 1), signature-checked up front.
    const witnessed = new Map<number, SignedLogHead[]>()
    const witness = { applied: 0, badSignature: 0, newest: undefined as SignedLogHead['body'] | undefined }
    for (const head of options.witnessedHeads ?? []) {
      const key = resolveKey(head.body.signer, certs.get(head.body.signer), options.publicKeyFor)
      if (!key.ok || !verifyLogHead(head, key.publicKey)) { witness.badSignature++; continue }
      const at = head.body.count - 1
      witnessed.set(at, [...(witnessed.get(at) ?? []), head])
    }
    const applied = new Set<SignedLogHead>()
    const apply = (head: SignedLogHead): void => {
      applied.add(head)
      if (witness.newest === undefined || head.body.count > witness.newest.count) witness.newest = head.body
    }
    const witnessReport = (): Pick<VerifyReport, 'witness'> => options.witnessedHeads === undefined
      ? {}
      : { witness: { applied: applied.size, badSignature: witness.badSignature, ...(witness.newest === undefined ? {} : { newest: { count: witness.newest.count, hash: witness.newest.hash, timestamp: witness.newest.timestamp } }) } }
    const report = (ok: boolean): VerifyReport => ({ ok, entries: expected, headHash: prevHash, signers, partSigners, ...(ca === undefined ? {} : { ca }), ...witnessReport() })
    const bad = (index: number, reason: VerifyReason, detail: string, id?: string): VerifyReport =>
      ({ ...report(false), firstBad: id === undefined ? { index, reason, detail } : { index, id, reason, detail } })
    // A log that stores certificates vouches for its signers through them; then a bare peer id is no key.
    // (With a CA, a signer without a stored certificate is reported as untrusted after its signature.)
    const requireCertificate = certs.size > 0

    for await (const [key, text] of db.iterator({ ...ENTRY_RANGE, snapshot })) {
      options.signal?.throwIfAborted()
      const index = parseEntryKey(key)
      if (index === undefined) return bad(expected, 'malformed', `unexpected key ${JSON.stringify(key)} among entries`)
      if (index !== expected) return bad(expected, 'missing-entry', `entry ${expected} is absent; the next stored entry is ${index}`)
      const entry = parseEntry(text)
      const problem = entry === undefined ? 'not JSON' : checkEntry(entry)
      const id = typeof (entry?.body as { id?: unknown } | undefined)?.id === 'string' ? entry?.body.id : undefined
      if (entry === undefined || problem !== undefined) return bad(index, 'malformed', problem ?? 'not JSON', id)
      const body: ReceiptBody = entry.body
      if (body.index !== index) return bad(index, 'index-mismatch', `body.index is ${body.index}`, id)
      if (body.prevHash !== prevHash) return bad(index, 'chain-broken', `prevHash ${body.prevHash} is not the previous entry's hash ${prevHash}`, id)
      const signer = resolveKey(body.signer, certs.get(body.signer), options.publicKeyFor, requireCertificate)
      if (!signer.ok) return bad(index, signer.reason, signer.detail, id)
      if (!verifyDocument(entry, signer.publicKey)) return bad(index, 'bad-signature', `signature does not verify with ${body.signer}'s key`, id)
      const untrusted = trust?.check(body.signer, certs.get(body.signer), signer.publicKey, body.timestamp)
      if (untrusted !== undefined) return bad(index, 'untrusted-signer', `signer ${untrusted}`, id)
      const parts = checkParts(body, certs, options)
      if (!parts.ok) return bad(index, 'bad-part', parts.detail, id)
      // Integrity of every part first, then trust: a forged part is 'bad-part' whoever signed it.
      for (let i = 0; i < parts.keys.length; i++) {
        const peerId = body.parts[i]!.body.peerId
        const why = trust?.check(peerId, certs.get(peerId), parts.keys[i]!, body.timestamp)
        if (why !== undefined) return bad(index, 'untrusted-signer', `part ${i} signer ${why}`, id)
      }
      const mapped = await db.get(KEY.id(body.id), { snapshot })
      if (mapped !== String(index)) return bad(index, 'id-mapping', mapped === undefined ? 'no id → index mapping' : `id maps to index ${mapped}`, id)
      prevHash = entryHash(entry as SignedReceipt)
      for (const head of witnessed.get(index) ?? []) {
        if (head.body.signer !== body.signer) continue
        apply(head)
        if (head.body.hash !== prevHash) return bad(index, 'witnessed-head', `a head ${body.signer} signed at ${when(head.body.timestamp)} says entry ${index} hashes to ${head.body.hash}; it hashes to ${prevHash} (the log was rewritten)`, id)
      }
      lastId = body.id
      if (!signers.some((s) => s.peerId === body.signer)) signers.push({ peerId: body.signer, certificate: certs.has(body.signer) })
      for (const part of body.parts) if (!partSigners.includes(part.body.peerId)) partSigners.push(part.body.peerId)
      expected++
    }

    const h = parseHead(head)
    if (expected === 0) {
      if (head !== undefined) return bad(h?.index ?? 0, h === undefined || h.index === 0 ? 'head-mismatch' : 'missing-entry', 'the log has no entries but a head pointer')
    } else {
      if (h === undefined) return bad(expected - 1, 'head-mismatch', head === undefined ? 'head pointer missing' : 'head pointer unreadable', lastId)
      if (h.index >= expected) return bad(expected, 'missing-entry', `head points at entry ${h.index} (${h.id}) but the log ends at ${expected - 1}`, expected === h.index ? h.id : undefined)
      if (h.index !== expected - 1 || h.hash !== prevHash || h.id !== lastId) return bad(expected - 1, 'head-mismatch', `head ${JSON.stringify(h)} differs from the last entry`, lastId)
    }
    // The log is consistent in itself; heads past its end show a witness saw entries it no longer has
    // (a cut tail with the head pointer rewritten to match). A log cut to nothing names no signer: not caught.
    const logSigners = new Set(signers.map(s => s.peerId))
    for (const [at, heads] of [...witnessed.entries()].sort((a, b) => b[0] - a[0])) {
      if (at < expected) continue
      const head = heads.find(h => logSigners.has(h.body.signer))
      if (head === undefined) continue
      apply(head)
      return bad(expected, 'witnessed-head', `a head ${head.body.signer} signed at ${when(head.body.timestamp)} says the log held ${head.body.count} entries (last hash ${head.body.hash}); it holds ${expected} (the tail was cut)`)
    }
    return report(true)
  } finally {
    await snapshot.close()
  }
}

function when (ms: number): string {
  const d = new Date(ms)
  return Number.isFinite(d.getTime()) ? d.toISOString() : String(ms)
}

/** Every part's signature, and the key each verified with (for the CA check). */
function checkParts (body: ReceiptBody, certs: Map<string, unknown>, options: VerifyOptions): { ok: true, keys: Uint8Array[] } | { ok: false, detail: string } {
  const keys: Uint8Array[] = []
  for (let i = 0; i < body.parts.length; i++) {
    const part = body.parts[i]!
    const key = resolveKey(part.body.peerId, certs.get(part.body.peerId), options.publicKeyFor)
    if (!key.ok) return { ok: false, detail: `part ${i} (${part.body.peerId}): ${key.detail}` }
    if (!verifyReceiptPart(part, key.publicKey)) return { ok: false, detail: `part ${i} (${part.body.peerId}): signature does not verify` }
    keys.push(key.publicKey)
  }
  return { ok: true, keys }
}
