/**
 * The node's append-only receipt log. Appends go through one bounded queue and one writer loop,
 * which chains, signs and writes them in synced level batches (several queued appends share one
 * batch: group commit), so the log order is the order of the chain and an append resolves only
 * once its entry is on disk.
 */
import { canonicalBytes, publicKeyOf, signDocument } from '../../certs/signed.ts'
import { InvalidReceiptError, LedgerBusyError, LedgerClosedError, LedgerCorruptError, SignerMismatchError } from './errors.ts'
import { AbortedError } from '../errors.ts'
import { stepMark } from '../step-trace.ts'
import { certificateKey, publicKeyFromPeerId, resolveKey, sameBytes } from './keys.ts'
import { checkReceiptInput, entryHash, GENESIS_HASH, RECEIPT_FORMAT, verifyReceiptPart } from './receipt.ts'
import type { ReceiptBody, ReceiptInput, SignedReceipt } from './receipt.ts'
import { CERT_RANGE, getReceipt, KEY, lastEntry, parseEntry, parseHead, receiptsLocation, STORE_FORMAT, tailText, openDb } from './store.ts'
import type { Head, LedgerDb } from './store.ts'
import { verifyLog } from './verify.ts'
import { verifyReceipt } from './verify-one.ts'
import type { ReceiptVerification } from './verify-one.ts'
import type { VerifyOptions, VerifyReport } from './verify.ts'

export interface LedgerSigner {
  peerId: string
  /** Raw 32-byte ed25519 seed. */
  secretKey: Uint8Array
  /** The node's certificate ({body: {peerId, publicKey}, signature}); stored once per peer id. */
  certificate?: unknown
}

export interface LedgerInit {
  /** The node's --data directory; the log lives in DATA/receipts. */
  dataDir: string
  signer: LedgerSigner
  /** Appends waiting to be written before append() refuses (default 1024). */
  maxPending?: number
  /** Key of an executor whose peer id embeds none (parts are checked against it on append). */
  publicKeyFor?: (peerId: string) => Uint8Array | undefined
  /** Clock for entry timestamps (epoch ms); tests may pin it. */
  now?: () => number
}

export interface LedgerComponents {
  logger?: { warn: (obj: object, msg?: string) => void }
}

export interface Ledger {
  start: () => Promise<void>
  /** Writes everything queued, then closes the database. */
  stop: () => Promise<void>
  /**
   * Chains, signs and durably appends; resolves with the stored entry. `certificates`: those of
   * the parts' signers (as the mesh admitted them), stored beside the entry in the same batch so
   * the log vouches for every key it holds signatures of (`receipts verify --ca` checks them).
   */
  append: (input: ReceiptInput, options?: AppendOptions) => Promise<SignedReceipt>
  /** The signed receipt and its signer's certificate (null when none was stored). */
  get: (id: string) => Promise<{ receipt: SignedReceipt, certificate: unknown } | undefined>
  verify: (options?: VerifyOptions) => Promise<VerifyReport>
  /** One receipt's form, signatures and both hash links (undefined when no receipt has this id). */
  verifyOne: (id: string) => Promise<ReceiptVerification | undefined>
  /** The last n receipts, oldest first. */
  tail: (n: number) => Promise<SignedReceipt[]>
  /** Entries in the log (index of the next append). */
  readonly size: number
  /** What a signed log head states: entries in the log and the hash of the last (GENESIS_HASH when empty). */
  readonly head: { count: number, hash: string }
  readonly location: string
}

export interface AppendOptions {
  signal?: AbortSignal
  certificates?: readonly unknown[]
}

interface Pending {
  input: ReceiptInput
  /** Part signers' certificates: [peer id, canonical JSON]. */
  certificates: Array<[string, string]>
  resolve: (entry: SignedReceipt) => void
  reject: (err: unknown) => void
  onAbort?: () => void
  signal?: AbortSignal
}

/** Most entries in one synced batch: bounds the time the event loop spends signing at once (~0.5 ms each). */
const MAX_GROUP = 16

export function createLedger (init: LedgerInit, components: LedgerComponents = {}): Ledger {
  const maxPending = init.maxPending ?? 1024
  const now = init.now ?? Date.now
  const signer = init.signer
  let db: LedgerDb | undefined
  let state: 'stopped' | 'running' | 'stopping' = 'stopped'
  let head: Head | undefined
  const queue: Pending[] = []
  let writer: Promise<void> = Promise.resolve()
  let draining = false
  /** Certificate text stored per peer id, so an unchanged one is not rewritten with every entry. */
  const storedCerts = new Map<string, string>()

  function checkSigner (): void {
    if (!(signer.secretKey instanceof Uint8Array) || signer.secretKey.length !== 32) throw new SignerMismatchError('signer secretKey must be a raw 32-byte ed25519 seed')
    const publicKey = publicKeyOf(signer.secretKey)
    const embedded = publicKeyFromPeerId(signer.peerId)
    if (embedded !== undefined && !sameBytes(embedded, publicKey)) throw new SignerMismatchError(`secret key does not belong to peer id ${signer.peerId}`)
    if (signer.certificate !== undefined) {
      const cert = certificateKey(signer.certificate)
      if (cert === undefined) throw new SignerMismatchError('signer certificate lacks body.peerId / body.publicKey')
      if (cert.peerId !== signer.peerId || !sameBytes(cert.publicKey, publicKey)) throw new SignerMismatchError('signer certificate names another peer id or key')
    } else if (embedded === undefined) {
      throw new SignerMismatchError(`peer id ${signer.peerId} embeds no ed25519 key and no certificate was given: receipts could not be verified`)
    }
  }

  /** Head from the last stored entry: the batch that wrote it also wrote the head, unless someone edited the db. */
  async function recoverHead (d: LedgerDb): Promise<Head | undefined> {
    const stored = parseHead(await d.get(KEY.head))
    const last = await lastEntry(d)
    if (last === undefined) {
      if (stored !== undefined) {
        components.logger?.warn({ head: stored }, 'receipt log has a head pointer but no entries; starting a new chain')
        await d.del(KEY.head, { sync: true })
      }
      return undefined
    }
    const entry = parseEntry(last.text)
    if (last.index === undefined || entry === undefined || typeof entry.body?.id !== 'string') {
      throw new LedgerCorruptError(`the last receipt entry (${last.key}) is unreadable; run \`shoal receipts verify --data ${init.dataDir}\``)
    }
    const actual: Head = { index: last.index, hash: entryHash(entry), id: entry.body.id }
    if (stored === undefined || stored.index !== actual.index || stored.hash !== actual.hash || stored.id !== actual.id) {
      if (stored !== undefined) components.logger?.warn({ head: stored, last: actual }, 'receipt log head differs from its last entry; continuing from the last entry')
      await d.put(KEY.head, JSON.stringify(actual), { sync: true })
    }
    return actual
  }

  let starting: Promise<void> | undefined
  async function start (): Promise<void> {
    if (state !== 'stopped') return
    starting ??= open().finally(() => { starting = undefined })
    await starting
  }

  async function open (): Promise<void> {
    checkSigner()
    const d = await openDb(init.dataDir, { create: true })
    try {
      const format = await d.get(KEY.format)
      if (format === undefined) await d.put(KEY.format, STORE_FORMAT, { sync: true })
      else if (format !== STORE_FORMAT) throw new LedgerCorruptError(`receipt log format ${format} is not ${STORE_FORMAT}`)
      head = await recoverHead(d)
      storedCerts.clear()
      for await (const [key, text] of d.iterator(CERT_RANGE)) storedCerts.set(key.slice(KEY.cert('').length), text)
      if (signer.certificate !== undefined) {
        const text = canonicalText(signer.certificate)
        if (storedCerts.get(signer.peerId) !== text) await d.put(KEY.cert(signer.peerId), text, { sync: true })
        storedCerts.set(signer.peerId, text)
      }
    } catch (err) {
      await d.close()
      throw err
    }
    db = d
    state = 'running'
  }

  async function stop (): Promise<void> {
    if (state !== 'running') return
    state = 'stopping'
    await writer
    await db?.close()
    db = undefined
    state = 'stopped'
  }

  function append (input: ReceiptInput, options: AppendOptions = {}): Promise<SignedReceipt> {
    if (state !== 'running') return Promise.reject(new LedgerClosedError())
    const malformed = checkReceiptInput(input)
    if (malformed !== undefined) return Promise.reject(new InvalidReceiptError(malformed))
    const certs = partCertificates(input, options.certificates ?? [])
    if (typeof certs === 'string') return Promise.reject(new InvalidReceiptError(certs))
    const forged = checkPartSignatures(input, certs)
    if (forged !== undefined) return Promise.reject(new InvalidReceiptError(forged))
    if (queue.length >= maxPending) return Promise.reject(new LedgerBusyError(queue.length))
    const signal = options.signal
    if (signal?.aborted === true) return Promise.reject(new AbortedError('receipt append aborted before it was written'))
    return new Promise<SignedReceipt>((resolve, reject) => {
      // Copy now, so a caller mutating its object later cannot change what gets signed.
      const item: Pending = { input: structuredClone(input), certificates: [...certs].map(([peerId, cert]) => [peerId, canonicalText(cert)]), resolve, reject }
      if (signal !== undefined) {
        item.signal = signal
        item.onAbort = () => {
          const at = queue.indexOf(item)
          if (at >= 0) {
            queue.splice(at, 1)
            reject(new AbortedError('receipt append aborted before it was written'))
          }
        }
        signal.addEventListener('abort', item.onAbort, { once: true })
      }
      queue.push(item)
      if (!draining) {
        // The flag is cleared in the same tick the loop sees an empty queue, so no append is stranded.
        draining = true
        writer = drain()
      }
    })
  }

  /** The given certificates by the part signer they belong to; a text saying why when one belongs to none. */
  function partCertificates (input: ReceiptInput, certificates: readonly unknown[]): Map<string, unknown> | string {
    const signers = new Set(input.parts.map(p => p.body.peerId))
    const out = new Map<string, unknown>()
    for (const [i, cert] of certificates.entries()) {
      const peerId = certificateKey(cert)?.peerId
      if (peerId === undefined || !signers.has(peerId)) return `certificate ${i} belongs to no part signer`
      out.set(peerId, cert)
    }
    return out
  }

  /** Parts are checked on the way in: an honest node must not write a log that fails verification. */
  function checkPartSignatures (input: ReceiptInput, certificates: Map<string, unknown>): string | undefined {
    for (const [i, part] of input.parts.entries()) {
      const key = resolveKey(part.body.peerId, certificates.get(part.body.peerId), init.publicKeyFor)
      if (!key.ok) return `part ${i} (${part.body.peerId}): ${key.detail}`
      if (!verifyReceiptPart(part, key.publicKey)) return `part ${i} (${part.body.peerId}): signature does not verify`
    }
    return undefined
  }

  function bodyOf (input: ReceiptInput, index: number, prevHash: string): ReceiptBody {
    // Explicit field list: unknown input fields are not signed.
    const body: ReceiptBody = {
      format: RECEIPT_FORMAT,
      index,
      id: input.id,
      signer: signer.peerId,
      timestamp: now(),
      prevHash,
      requestHash: input.requestHash,
      responseHash: input.responseHash,
      model: { id: input.model.id, manifestHash: input.model.manifestHash },
      route: input.route,
      parts: input.parts,
      usage: { promptTokens: input.usage.promptTokens, completionTokens: input.usage.completionTokens },
      timing: { startedAt: input.timing.startedAt, firstTokenMs: input.timing.firstTokenMs, totalMs: input.timing.totalMs },
      finishReason: input.finishReason,
    }
    if (input.client !== undefined) body.client = { name: input.client.name, serial: input.client.serial }
    if (input.speculation !== undefined) body.speculation = { drafter: input.speculation.drafter, drafted: input.speculation.drafted, accepted: input.speculation.accepted }
    if (input.prefix !== undefined) body.prefix = { peerId: input.prefix.peerId, reusedTokens: input.prefix.reusedTokens, ...(input.prefix.movedFrom === undefined ? {} : { movedFrom: input.prefix.movedFrom }) }
    return body
  }

  async function drain (): Promise<void> {
    while (true) {
      if (queue.length === 0) {
        draining = false
        return
      }
      const group = queue.splice(0, MAX_GROUP)
      for (const item of group) if (item.onAbort !== undefined) item.signal?.removeEventListener('abort', item.onAbort)
      const d = db!
      try {
        // Read synchronously: an id not in the log (the rule, request ids being fresh UUIDs) is a
        // miss that LevelDB's bloom filters answer from memory in ~10–80 µs, where the asynchronous
        // read's thread hand-offs took 0.4–0.6 ms of a served 128-token request
        // (docs/engine-notes.md, wave 17). A stored id, or a filter's false positive, reads one
        // block, from the page cache as a rule.
        const existing = group.map((g) => d.getSync(KEY.id(g.input.id)))
        const seen = new Set<string>()
        const ops: Array<{ type: 'put', key: string, value: string }> = []
        const done: Array<[Pending, SignedReceipt]> = []
        let index = head === undefined ? 0 : head.index + 1
        let prevHash = head?.hash ?? GENESIS_HASH
        let next: Head | undefined
        group.forEach((item, i) => {
          if (existing[i] !== undefined || seen.has(item.input.id)) {
            item.reject(new InvalidReceiptError(`receipt id ${item.input.id} is already in the log`))
            return
          }
          seen.add(item.input.id)
          const entry = signDocument(bodyOf(item.input, index, prevHash), signer.secretKey)
          ops.push({ type: 'put', key: KEY.entry(index), value: JSON.stringify(entry) })
          ops.push({ type: 'put', key: KEY.id(item.input.id), value: String(index) })
          for (const [peerId, text] of item.certificates) {
            if (storedCerts.get(peerId) === text || ops.some(op => op.key === KEY.cert(peerId) && op.value === text)) continue
            ops.push({ type: 'put', key: KEY.cert(peerId), value: text })
          }
          prevHash = entryHash(entry)
          next = { index, hash: prevHash, id: item.input.id }
          done.push([item, entry])
          index++
        })
        if (next === undefined) continue
        ops.push({ type: 'put', key: KEY.head, value: JSON.stringify(next) })
        stepMark('l.batch')
        await d.batch(ops, { sync: true })
        stepMark('l.synced')
        for (const op of ops) if (op.key.startsWith(KEY.cert(''))) storedCerts.set(op.key.slice(KEY.cert('').length), op.value)
        head = next
        for (const [item, entry] of done) item.resolve(entry)
      } catch (err) {
        // Nothing of this group is on disk (a level batch is atomic); the head stays where it was.
        for (const item of group) item.reject(err)
      }
    }
  }

  function opened (): LedgerDb {
    if (db === undefined || state === 'stopped') throw new LedgerClosedError()
    return db
  }

  return {
    start,
    stop,
    append,
    get: async (id) => await getReceipt(opened(), id),
    verify: async (options) => await verifyLog(opened(), options),
    verifyOne: async (id) => await verifyReceipt(opened(), id),
    async tail (n) {
      if (!Number.isSafeInteger(n) || n < 0) throw new RangeError('tail(n) needs a non-negative integer')
      const rows = await tailText(opened(), n)
      return rows.map((r) => {
        const entry = parseEntry(r.text)
        if (entry === undefined) throw new LedgerCorruptError(`receipt entry ${r.index ?? '?'} is not JSON`)
        return entry
      })
    },
    get size () { return head === undefined ? 0 : head.index + 1 },
    get head () { return head === undefined ? { count: 0, hash: GENESIS_HASH } : { count: head.index + 1, hash: head.hash } },
    location: receiptsLocation(init.dataDir),
  }
}

function canonicalText (value: unknown): string {
  return new TextDecoder().decode(canonicalBytes(value))
}
