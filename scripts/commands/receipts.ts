/**
 * `shoal receipts verify|show --data DIR`: check or print a node's receipt log. Works on the log's
 * level database directly, so it needs no identity. While a node runs, level holds a lock on the
 * database: then the command works on a copy of it taken at that moment (a consistent prefix of the
 * log: every append is one atomic batch), without stopping the node. `verify --ca FILE` also
 * checks that the operator's CA vouched for every signer; without it, a log full of self-made
 * certificates verifies too. `verify --heads FILE` checks the log against the heads its signer
 * handed to peers (their witnessed-heads.json): a cut tail then fails.
 */
import { cp, mkdtemp, readFile, rm, stat } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { ExitError } from '../exit-error.ts'
import { parseCaCertificate } from '../../certs/index.ts'
import type { CaCertificate } from '../../certs/index.ts'
import { allText, hasLog, headsFromFile, openDb, receiptsLocation, tailText, verifyLog } from '../../daemon/ledger/index.ts'
import type { LedgerDb, SignedLogHead, VerifyReport } from '../../daemon/ledger/index.ts'

type Print = (line: string) => void
const MAX_CA_FILE = 64 * 1024
const stdout: Print = (line) => { process.stdout.write(line + '\n') }

interface OpenLog {
  db: LedgerDb
  /** Set when the node holds the log: the time the copy that `db` reads was taken. */
  copiedAt?: Date
  close (): Promise<void>
}

const isLocked = (err: unknown): boolean => (err as { cause?: { code?: string } }).cause?.code === 'LEVEL_LOCKED'
const COPY_ATTEMPTS = 5

async function openLog (data: unknown, print?: Print): Promise<OpenLog> {
  if (typeof data !== 'string' || data === '') throw new ExitError('receipts: --data DIR is required')
  const dir = await stat(data).catch(() => undefined)
  if (dir === undefined || !dir.isDirectory()) throw new ExitError(`receipts: no such data directory: ${data}`)
  if (!(await hasLog(data))) throw new ExitError(`receipts: no receipt log in ${data} (expected a level database at ${receiptsLocation(data)})`)
  try {
    const db = await openDb(data, { create: false })
    return { db, close: async () => { await db.close() } }
  } catch (err) {
    if (isLocked(err)) return await openCopy(data, print)
    throw new ExitError(`receipts: cannot open ${receiptsLocation(data)}: ${(err as Error).message}`)
  }
}

/**
 * A running node holds the log's lock: read a copy of its files instead. Entries only ever grow
 * and each append (entry, id, head) is one atomic level batch, so the copy is the log as it stood
 * at some moment — a prefix of the live one. A compaction running during the copy can leave it
 * naming a file it lacks; then the copy is taken again.
 */
async function openCopy (data: string, print?: Print): Promise<OpenLog> {
  let lastError: unknown
  for (let attempt = 0; attempt < COPY_ATTEMPTS; attempt++) {
    const root = await mkdtemp(join(tmpdir(), 'shoal-receipts-copy-'))
    const cleanup = async (): Promise<void> => { await rm(root, { recursive: true, force: true }) }
    try {
      const copiedAt = new Date()
      await cp(receiptsLocation(data), receiptsLocation(root), { recursive: true, filter: src => !src.endsWith('LOCK') })
      const db = await openDb(root, { create: false })
      print?.(`note: ${receiptsLocation(data)} is in use by a running node; reading a copy taken at ${copiedAt.toISOString()}`)
      return { db, copiedAt, close: async () => { await db.close().catch(() => {}); await cleanup() } }
    } catch (err) {
      lastError = err
      await cleanup()
    }
  }
  throw new ExitError(`receipts: ${receiptsLocation(data)} is in use by a running node and a copy of it could not be read (${(lastError as Error).message})`)
}

/** Signed heads from witness files (`witnessed-heads.json` of peers, or a JSON array of signed heads). */
async function readHeads (files: string[]): Promise<{ heads: SignedLogHead[], malformed: number }> {
  const heads: SignedLogHead[] = []
  let malformed = 0
  for (const file of files) {
    const info = await stat(file).catch(() => undefined)
    if (info === undefined || !info.isFile()) throw new ExitError(`receipts: --heads ${file}: no such file`)
    if (info.size > MAX_HEADS_FILE) throw new ExitError(`receipts: --heads ${file}: larger than ${MAX_HEADS_FILE} bytes`)
    let doc: unknown
    try {
      doc = JSON.parse(await readFile(file, 'utf8'))
    } catch {
      throw new ExitError(`receipts: --heads ${file}: not JSON`)
    }
    const found = headsFromFile(doc)
    if (found.heads.length === 0 && found.malformed > 0) throw new ExitError(`receipts: --heads ${file}: not a witnessed-heads file (shoal.witnessed-heads/1) nor signed log heads`)
    heads.push(...found.heads)
    malformed += found.malformed
  }
  return { heads, malformed }
}

const MAX_HEADS_FILE = 8 * 1024 * 1024

/** The CA certificate file (`ca.cert.json` from `shoal ca init`), checked; ExitError(…, 2) when it is not one. */
async function readCa (file: unknown): Promise<CaCertificate> {
  if (typeof file !== 'string' || file === '') throw new ExitError('receipts: --ca needs a CA certificate file (ca.cert.json from `shoal ca init`)')
  const info = await stat(file).catch(() => undefined)
  if (info === undefined || !info.isFile()) throw new ExitError(`receipts: --ca ${file}: no such file`)
  // A CA certificate is a few hundred bytes; anything much larger is not one.
  if (info.size > MAX_CA_FILE) throw new ExitError(`receipts: --ca ${file}: not a CA certificate (${info.size} bytes)`)
  let doc: unknown
  try {
    doc = JSON.parse(await readFile(file, 'utf8'))
  } catch (err) {
    throw new ExitError(`receipts: --ca ${file}: ${err instanceof SyntaxError ? 'not JSON' : `cannot be read (${(err as { code?: string }).code ?? 'error'})`}`)
  }
  try {
    return parseCaCertificate(doc)
  } catch (err) {
    throw new ExitError(`receipts: --ca ${file}: not a valid CA certificate: ${(err as Error).message}`)
  }
}

/**
 * Exit 0 when every signature and link holds (and, with `ca`, every signer holds a certificate from
 * that CA valid at each receipt's time; revocation is not checked); ExitError(…, 1) naming the first
 * bad entry otherwise.
 */
export async function receiptsVerify (opts: { data: string, ca?: string, heads?: string[] }, print: Print = stdout): Promise<VerifyReport> {
  const ca = opts.ca === undefined ? undefined : await readCa(opts.ca)
  const witnessed = opts.heads === undefined || opts.heads.length === 0 ? undefined : await readHeads(opts.heads)
  const log = await openLog(opts.data, print)
  let report: VerifyReport
  try {
    report = await verifyLog(log.db, { ...(ca === undefined ? {} : { ca }), ...(witnessed === undefined ? {} : { witnessedHeads: witnessed.heads }) })
  } finally {
    await log.close()
  }
  if (report.firstBad !== undefined) {
    const bad = report.firstBad
    const name = bad.id === undefined ? `entry ${bad.index}` : `entry ${bad.index} (id ${bad.id})`
    throw new ExitError(`receipts: ${name}: ${bad.reason}: ${bad.detail} (${report.entries} entries before it verified)`, 1)
  }
  print(`ok: ${report.entries} entries, every signature and hash link verified; head ${report.headHash}`)
  // Who signed matters: compare these with the node identities you expect (and their CA).
  for (const s of report.signers) print(`signer ${s.peerId} (key from ${s.certificate ? 'stored certificate' : 'peer id'})`)
  if (ca !== undefined) {
    const parts = report.partSigners.length === 0 ? '' : ` and ${report.partSigners.length} part signer${report.partSigners.length === 1 ? '' : 's'} (${report.partSigners.join(', ')})`
    print(`ca: every signer${parts} chains to CA "${ca.body.name}" (key id ${ca.body.keyId}) with a certificate valid at each receipt's time (revocation is not checked)`)
  }
  if (witnessed !== undefined) {
    const w = report.witness
    const skipped = (w?.badSignature ?? 0) + witnessed.malformed
    const note = skipped === 0 ? '' : ` (${skipped} head${skipped === 1 ? '' : 's'} skipped: malformed or not verifying)`
    if (w === undefined || w.applied === 0 || w.newest === undefined) {
      print(`witness: none of the ${witnessed.heads.length} witnessed heads was signed by this log's signer, so they say nothing about it${note}`)
    } else {
      print(`witness: consistent with ${w.applied} witnessed head${w.applied === 1 ? '' : 's'} of this log's signer; the newest saw ${w.newest.count} entries at ${new Date(w.newest.timestamp).toISOString()}${note}`)
    }
  }
  return report
}

/** Prints receipts one JSON document per line ({"body", "signature"}), oldest first. */
export async function receiptsShow (opts: { data: string, last?: string }, print: Print = stdout): Promise<number> {
  let last: number | undefined
  if (opts.last !== undefined) {
    if (!/^\d+$/.test(opts.last) || Number(opts.last) < 1 || !Number.isSafeInteger(Number(opts.last))) throw new ExitError(`receipts: --last needs a positive integer, got ${JSON.stringify(opts.last)}`)
    last = Number(opts.last)
  }
  const log = await openLog(opts.data, line => { process.stderr.write(line + '\n') })
  const db = log.db
  let count = 0
  const emit = (row: { index: number | undefined, text: string }): void => {
    // Re-serialize what parses (one line each); show what does not as a marked raw string.
    let line: string
    try {
      line = JSON.stringify(JSON.parse(row.text))
    } catch {
      line = JSON.stringify({ index: row.index ?? null, unparseable: row.text })
    }
    print(line)
    count++
  }
  try {
    if (last !== undefined) for (const row of await tailText(db, last)) emit(row)
    else for await (const row of allText(db)) emit(row)
  } finally {
    await log.close()
  }
  return count
}
