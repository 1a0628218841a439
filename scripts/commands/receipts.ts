/**
 * `shoal receipts verify|show --data DIR`: check or print a node's receipt log. Works on the log's
 * level database directly, so it needs no identity — but the node must not be running (level
 * holds a lock on the database). `verify --ca FILE` also checks that the operator's CA vouched for
 * every signer; without it, a log full of self-made certificates verifies too.
 */
import { readFile, stat } from 'node:fs/promises'
import { ExitError } from '../exit-error.ts'
import { parseCaCertificate } from '../../certs/index.ts'
import type { CaCertificate } from '../../certs/index.ts'
import { allText, hasLog, openDb, receiptsLocation, tailText, verifyLog } from '../../daemon/ledger/index.ts'
import type { LedgerDb, VerifyReport } from '../../daemon/ledger/index.ts'

type Print = (line: string) => void
const MAX_CA_FILE = 64 * 1024
const stdout: Print = (line) => { process.stdout.write(line + '\n') }

async function openLog (data: unknown): Promise<LedgerDb> {
  if (typeof data !== 'string' || data === '') throw new ExitError('receipts: --data DIR is required')
  const dir = await stat(data).catch(() => undefined)
  if (dir === undefined || !dir.isDirectory()) throw new ExitError(`receipts: no such data directory: ${data}`)
  if (!(await hasLog(data))) throw new ExitError(`receipts: no receipt log in ${data} (expected a level database at ${receiptsLocation(data)})`)
  try {
    return await openDb(data, { create: false })
  } catch (err) {
    const cause = (err as { cause?: { code?: string } }).cause
    if (cause?.code === 'LEVEL_LOCKED') throw new ExitError(`receipts: ${receiptsLocation(data)} is locked — stop the node using it first`)
    throw new ExitError(`receipts: cannot open ${receiptsLocation(data)}: ${(err as Error).message}`)
  }
}

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
export async function receiptsVerify (opts: { data: string, ca?: string }, print: Print = stdout): Promise<VerifyReport> {
  const ca = opts.ca === undefined ? undefined : await readCa(opts.ca)
  const db = await openLog(opts.data)
  let report: VerifyReport
  try {
    report = await verifyLog(db, ca === undefined ? {} : { ca })
  } finally {
    await db.close()
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
  return report
}

/** Prints receipts one JSON document per line ({"body", "signature"}), oldest first. */
export async function receiptsShow (opts: { data: string, last?: string }, print: Print = stdout): Promise<number> {
  let last: number | undefined
  if (opts.last !== undefined) {
    if (!/^\d+$/.test(opts.last) || Number(opts.last) < 1 || !Number.isSafeInteger(Number(opts.last))) throw new ExitError(`receipts: --last needs a positive integer, got ${JSON.stringify(opts.last)}`)
    last = Number(opts.last)
  }
  const db = await openLog(opts.data)
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
    await db.close()
  }
  return count
}
