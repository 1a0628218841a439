/**
 * Checks one receipt where it sits in a running node's log, without walking the whole log (that is
 * `verifyLog`): its form, its signature and its embedded parts' signatures with the stored
 * certificates, and both of its hash links — its `prevHash` against the entry before it, and the
 * next entry's `prevHash` against it. A dashboard's "verify" button calls this; it reads one
 * snapshot, so it is safe while the ledger appends.
 */
import { verifyDocument } from '../../certs/signed.ts'
import { resolveKey } from './keys.ts'
import { checkEntry, entryHash, GENESIS_HASH, verifyReceiptPart } from './receipt.ts'
import type { SignedReceipt } from './receipt.ts'
import { KEY, parseEntry, readCertificates } from './store.ts'
import type { LedgerDb } from './store.ts'

export interface ReceiptCheck {
  /** What was checked, in order. */
  name: 'form' | 'signature' | 'parts' | 'previous-link' | 'next-link'
  ok: boolean
  detail: string
}

export interface ReceiptVerification {
  id: string
  /** True when every check passed. */
  ok: boolean
  index?: number
  signer?: string
  /** sha256 of this entry: what the next entry's prevHash must be. */
  hash?: string
  checks: ReceiptCheck[]
}

/** Undefined when the log has no receipt with this id. */
export async function verifyReceipt (db: LedgerDb, id: string): Promise<ReceiptVerification | undefined> {
  const snapshot = db.snapshot()
  try {
    const indexText = await db.get(KEY.id(id), { snapshot })
    if (indexText === undefined || !/^\d+$/.test(indexText)) return undefined
    const index = Number(indexText)
    const text = await db.get(KEY.entry(index), { snapshot })
    const entry = text === undefined ? undefined : parseEntry(text)
    const checks: ReceiptCheck[] = []
    const done = (extra: Partial<ReceiptVerification> = {}): ReceiptVerification =>
      ({ id, ok: checks.every(c => c.ok), index, ...extra, checks })

    const problem = entry === undefined ? 'the entry is missing or not JSON' : checkEntry(entry)
    checks.push({ name: 'form', ok: problem === undefined, detail: problem ?? `entry ${index} is a well-formed receipt` })
    if (entry === undefined || problem !== undefined) return done()
    const body = entry.body
    if (body.id !== id || body.index !== index) {
      checks[0] = { name: 'form', ok: false, detail: `the entry at ${index} is receipt ${body.id} at index ${body.index}` }
      return done()
    }
    const hash = entryHash(entry)

    const certs = await readCertificates(db, snapshot)
    // A log that stores certificates vouches for its signers through them (as verifyLog does).
    const key = resolveKey(body.signer, certs.get(body.signer), undefined, certs.size > 0)
    checks.push(key.ok
      ? verifyDocument(entry, key.publicKey)
        ? { name: 'signature', ok: true, detail: `signed by ${body.signer}` }
        : { name: 'signature', ok: false, detail: `the signature does not verify with ${body.signer}'s key` }
      : { name: 'signature', ok: false, detail: key.detail })

    let partsDetail = body.parts.length === 0 ? 'no embedded parts' : `${body.parts.length} part(s) verify`
    let partsOk = true
    for (const [i, part] of body.parts.entries()) {
      const k = resolveKey(part.body.peerId, certs.get(part.body.peerId))
      if (!k.ok || !verifyReceiptPart(part, k.publicKey)) {
        partsOk = false
        partsDetail = `part ${i} (${part.body.peerId}): ${k.ok ? 'signature does not verify' : k.detail}`
        break
      }
    }
    checks.push({ name: 'parts', ok: partsOk, detail: partsDetail })

    checks.push(await previousLink(db, snapshot, index, body.prevHash))
    const nextText = await db.get(KEY.entry(index + 1), { snapshot })
    const next = nextText === undefined ? undefined : parseEntry(nextText)
    checks.push(nextText === undefined
      ? { name: 'next-link', ok: true, detail: 'the newest entry: nothing links to it yet' }
      : next?.body?.prevHash === hash
        ? { name: 'next-link', ok: true, detail: `entry ${index + 1} links to it` }
        : { name: 'next-link', ok: false, detail: `entry ${index + 1}'s prevHash is not this entry's hash` })
    return done({ signer: body.signer, hash })
  } finally {
    await snapshot.close()
  }
}

async function previousLink (db: LedgerDb, snapshot: ReturnType<LedgerDb['snapshot']>, index: number, prevHash: string): Promise<ReceiptCheck> {
  if (index === 0) {
    return prevHash === GENESIS_HASH
      ? { name: 'previous-link', ok: true, detail: 'the first entry: prevHash is the genesis hash' }
      : { name: 'previous-link', ok: false, detail: 'the first entry must have the genesis prevHash' }
  }
  const text = await db.get(KEY.entry(index - 1), { snapshot })
  const prev = text === undefined ? undefined : parseEntry(text)
  if (prev === undefined) return { name: 'previous-link', ok: false, detail: `entry ${index - 1} is missing or unreadable` }
  return entryHash(prev as SignedReceipt) === prevHash
    ? { name: 'previous-link', ok: true, detail: `prevHash is entry ${index - 1}'s hash` }
    : { name: 'previous-link', ok: false, detail: `prevHash is not entry ${index - 1}'s hash` }
}
