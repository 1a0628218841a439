/**
 * The receipt log's level layout and read side. One level database at DATA/receipts, utf8 keys
 * and values:
 *
 *   e/<index, 16 decimal digits>  → the signed entry, JSON text ({"body": …, "signature": …})
 *   i/<receipt id>                → its index, decimal text
 *   c/<peer id>                   → the certificate of a signer (of entries or of parts), JSON text (latest one given)
 *   m/head                        → {"index", "hash", "id"} of the last entry, JSON text
 *   m/format                      → "1"
 *
 * Every append writes its e/, i/ and m/head keys (and any new part signer's c/) in one synced batch,
 * so a crash leaves all or none.
 */
import { mkdir, stat } from 'node:fs/promises'
import { join } from 'node:path'
import { Level } from 'level'
import type { SignedReceipt } from './receipt.ts'

export const STORE_FORMAT = '1'
export const RECEIPTS_DIR = 'receipts'

export type LedgerDb = Level<string, string>
/** A level snapshot (abstract-level is level's own dependency, so its type is reached through Level's). */
type AbstractSnapshot = ReturnType<LedgerDb['snapshot']>

export const KEY = {
  entry: (index: number): string => `e/${String(index).padStart(16, '0')}`,
  id: (id: string): string => `i/${id}`,
  cert: (peerId: string): string => `c/${peerId}`,
  head: 'm/head',
  format: 'm/format',
}
/** Key range of all entries ('/' < '0'). */
export const ENTRY_RANGE = { gte: 'e/', lt: 'e0' }
export const CERT_RANGE = { gte: 'c/', lt: 'c0' }

export function parseEntryKey (key: string): number | undefined {
  const m = /^e\/(\d{16})$/.exec(key)
  return m === null ? undefined : Number(m[1])
}

export interface Head {
  index: number
  hash: string
  id: string
}

export function parseHead (text: string | undefined): Head | undefined {
  if (text === undefined) return undefined
  try {
    const h = JSON.parse(text) as Partial<Head>
    if (typeof h.index === 'number' && typeof h.hash === 'string' && typeof h.id === 'string') return { index: h.index, hash: h.hash, id: h.id }
  } catch {}
  return undefined
}

export function receiptsLocation (dataDir: string): string {
  return join(dataDir, RECEIPTS_DIR)
}

/** Opens (creating when asked) the level database of a data directory. */
export async function openDb (dataDir: string, options: { create: boolean }): Promise<LedgerDb> {
  if (options.create) await mkdir(dataDir, { recursive: true })
  const db = new Level<string, string>(receiptsLocation(dataDir), { valueEncoding: 'utf8', keyEncoding: 'utf8', createIfMissing: options.create })
  await db.open()
  return db
}

/** True when `dataDir` holds a receipt log (without opening it). */
export async function hasLog (dataDir: string): Promise<boolean> {
  try {
    return (await stat(join(receiptsLocation(dataDir), 'CURRENT'))).isFile()
  } catch {
    return false
  }
}

export function parseEntry (text: string): SignedReceipt | undefined {
  try {
    const v = JSON.parse(text) as unknown
    return typeof v === 'object' && v !== null ? v as SignedReceipt : undefined
  } catch {
    return undefined
  }
}

/** The last stored entry (highest index), raw. */
export async function lastEntry (db: LedgerDb, snapshot?: AbstractSnapshot): Promise<{ key: string, index: number | undefined, text: string } | undefined> {
  for await (const [key, text] of db.iterator({ ...ENTRY_RANGE, reverse: true, limit: 1, snapshot })) {
    return { key, index: parseEntryKey(key), text }
  }
  return undefined
}

/** All stored certificates by peer id (a log holds one per signer it has had: few). */
export async function readCertificates (db: LedgerDb, snapshot?: AbstractSnapshot): Promise<Map<string, unknown>> {
  const certs = new Map<string, unknown>()
  for await (const [key, text] of db.iterator({ ...CERT_RANGE, snapshot })) {
    try {
      certs.set(key.slice(2), JSON.parse(text) as unknown)
    } catch {
      certs.set(key.slice(2), null) // present but unreadable: the verifier reports it
    }
  }
  return certs
}

/** The signed receipt with this id and its signer's stored certificate (null when none). */
export async function getReceipt (db: LedgerDb, id: string): Promise<{ receipt: SignedReceipt, certificate: unknown } | undefined> {
  const indexText = await db.get(KEY.id(id))
  if (indexText === undefined || !/^\d+$/.test(indexText)) return undefined
  const text = await db.get(KEY.entry(Number(indexText)))
  const receipt = text === undefined ? undefined : parseEntry(text)
  if (receipt === undefined || receipt.body?.id !== id) return undefined
  const certText = typeof receipt.body.signer === 'string' ? await db.get(KEY.cert(receipt.body.signer)) : undefined
  let certificate: unknown = null
  if (certText !== undefined) {
    try {
      certificate = JSON.parse(certText)
    } catch {}
  }
  return { receipt, certificate }
}

/** The last `n` entries as stored text, oldest first. */
export async function tailText (db: LedgerDb, n: number): Promise<Array<{ index: number | undefined, text: string }>> {
  const out: Array<{ index: number | undefined, text: string }> = []
  if (n <= 0) return out
  for await (const [key, text] of db.iterator({ ...ENTRY_RANGE, reverse: true, limit: n })) {
    out.push({ index: parseEntryKey(key), text })
  }
  return out.reverse()
}

/** Every entry as stored text, oldest first, streamed. */
export async function * allText (db: LedgerDb): AsyncGenerator<{ index: number | undefined, text: string }> {
  for await (const [key, text] of db.iterator(ENTRY_RANGE)) yield { index: parseEntryKey(key), text }
}
