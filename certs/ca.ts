/**
 * The operator CA directory: `ca.key` (0600), `ca.cert.json`, `revocations.json` and `registry/`
 * (a level database of what was issued, by node name). Every operation holds the registry open
 * for its whole length; level's exclusive lock makes concurrent operations on one CA refuse
 * (`busy`) instead of racing on the revocation number.
 */
import { lstat, mkdir, readdir, rm } from 'node:fs/promises'
import { dirname, join } from 'node:path'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import { Level } from 'level'
import { CaError, CertificateError } from './errors.ts'
import { readJsonFile, readPrivateKeyFile, seedOf, writeJsonAtomic, writePrivateKeyFile } from './files.ts'
import { createCaCertificate, createNodeCertificate, createRevocationList } from './issue.ts'
import { createClientKey, encodeClientKey } from './client-key.ts'
import { ROLES, isValidName, toTimestamp } from './schema.ts'
import type { CaCertificate, ClientKey, NodeCertificate, RevocationList, Role } from './schema.ts'
import { parseCaCertificate, parseRevocationList } from './verify.ts'
import { toBase64url } from './signed.ts'

export const CA_VALIDITY_DAYS = 3652
export const MAX_NODE_DAYS = 3650
const DAY_MS = 24 * 60 * 60 * 1000

interface RegistryEntry {
  name: string
  serial: string
  peerId: string
  roles: Role[]
  notBefore: string
  notAfter: string
  issuedAt: string
  certificate: NodeCertificate
}

/** A client key as the registry remembers it: never the token itself (a bearer secret). */
interface KeyEntry {
  name: string
  serial: string
  notBefore: string
  notAfter: string
  issuedAt: string
}

type Registry = Level<string, RegistryEntry | KeyEntry>

export interface NodeListing { name: string, peerId: string, serial: string, roles: Role[], notAfter: string, revoked: boolean }
export interface KeyListing { name: string, serial: string, notAfter: string, revoked: boolean }

const paths = (dir: string) => ({
  key: join(dir, 'ca.key'),
  cert: join(dir, 'ca.cert.json'),
  revocations: join(dir, 'revocations.json'),
  registry: join(dir, 'registry'),
})

async function exists (path: string): Promise<boolean> {
  try {
    await lstat(path)
    return true
  } catch {
    return false
  }
}

async function openRegistry (dir: string, create: boolean): Promise<Registry> {
  const db: Registry = new Level<string, RegistryEntry | KeyEntry>(paths(dir).registry, { valueEncoding: 'json', createIfMissing: create })
  try {
    await db.open()
  } catch (err) {
    const cause = (err as { cause?: { code?: unknown } }).cause
    if (cause?.code === 'LEVEL_LOCKED') throw new CaError('busy', `CA ${dir} is in use by another operation; try again`)
    throw new CaError('not-found', `CA ${dir} has no readable registry (${paths(dir).registry})`, { cause: err })
  }
  return db
}

async function withRegistry<T> (dir: string, create: boolean, fn: (db: Registry) => Promise<T>): Promise<T> {
  const db = await openRegistry(dir, create)
  try {
    return await fn(db)
  } finally {
    await db.close().catch(() => {})
  }
}

interface LoadedCa { secretKey: Uint8Array, certificate: CaCertificate }

async function loadCa (dir: string): Promise<LoadedCa> {
  const p = paths(dir)
  if (!await exists(p.key)) throw new CaError('not-found', `${dir} holds no CA (no ca.key); create one with: shoal ca init --dir ${dir}`)
  const key = await readPrivateKeyFile(p.key)
  const certificate = parseCaCertificate(await readJsonFile(p.cert))
  if (toBase64url(key.publicKey.raw) !== certificate.body.publicKey) {
    throw new CertificateError('wrong-ca', `${p.key} does not belong to ${p.cert}`)
  }
  return { secretKey: seedOf(key), certificate }
}

async function loadRevocations (dir: string, ca: CaCertificate): Promise<RevocationList> {
  return parseRevocationList(ca, await readJsonFile(paths(dir).revocations))
}

/** Creates a CA in `dir` (absent or empty). Refuses to touch an existing one. */
export async function initCa (dir: string, options: { name?: string, now?: Date } = {}): Promise<CaCertificate> {
  const name = options.name ?? 'shoal-ca'
  if (!isValidName(name)) throw new CaError('bad-option', `CA name ${JSON.stringify(name)} is not 1-64 letters, digits, . _ -`)
  const p = paths(dir)
  if (await exists(dir)) {
    const info = await lstat(dir)
    if (!info.isDirectory()) throw new CaError('exists', `${dir} exists and is not a directory; refusing to overwrite`)
    if ((await readdir(dir)).length > 0) {
      const what = await exists(p.key) ? 'already holds a CA' : 'is not empty'
      throw new CaError('exists', `${dir} ${what}; refusing to overwrite`)
    }
  }
  await mkdir(dir, { recursive: true, mode: 0o700 })
  const key = await generateKeyPair('Ed25519')
  try {
    await writePrivateKeyFile(p.key, key)
  } catch (err) {
    if ((err as { code?: unknown }).code === 'EEXIST') throw new CaError('exists', `${dir} already holds a CA; refusing to overwrite`)
    throw new CertificateError('file', `${p.key} cannot be written`, { cause: err })
  }
  const now = options.now ?? new Date()
  const secretKey = seedOf(key)
  const certificate = createCaCertificate(secretKey, { name, notBefore: now, notAfter: new Date(now.getTime() + CA_VALIDITY_DAYS * DAY_MS) })
  await writeJsonAtomic(p.cert, certificate)
  await writeJsonAtomic(p.revocations, createRevocationList(secretKey, certificate, { number: 0, revoked: [], issuedAt: now }))
  await withRegistry(dir, true, async () => {})
  return parseCaCertificate(certificate)
}

function checkRoles (roles: readonly string[]): Role[] {
  if (roles.length === 0) throw new CaError('bad-option', `roles must name at least one of ${ROLES.join(', ')}`)
  const out: Role[] = []
  for (const role of roles) {
    if (!(ROLES as readonly string[]).includes(role)) throw new CaError('bad-option', `unknown role ${JSON.stringify(role)}; roles are ${ROLES.join(', ')}`)
    if (out.includes(role as Role)) throw new CaError('bad-option', `role ${role} is given twice`)
    out.push(role as Role)
  }
  return out
}

function validityOf (options: { days?: number, notBefore?: Date, notAfter?: Date }): { notBefore: Date, notAfter: Date } {
  const days = options.days ?? 365
  if (!Number.isSafeInteger(days) || days < 1 || days > MAX_NODE_DAYS) {
    throw new CaError('bad-option', `days must be a whole number from 1 to ${MAX_NODE_DAYS}`)
  }
  const notBefore = options.notBefore ?? new Date()
  const notAfter = options.notAfter ?? new Date(notBefore.getTime() + days * DAY_MS)
  if (!(notAfter.getTime() - notBefore.getTime() >= 1000)) throw new CaError('bad-option', 'notAfter must be after notBefore')
  return { notBefore, notAfter }
}

/** Creates identity directory `outDir` (node.key, node.cert.json, ca.cert.json) for a new node. */
export async function issueNode (caDir: string, options: {
  name: string
  outDir: string
  days?: number
  roles?: Role[]
  notBefore?: Date
  notAfter?: Date
}): Promise<{ peerId: string, certificate: NodeCertificate }> {
  const { name, outDir } = options
  if (!isValidName(name)) throw new CaError('bad-option', `node name ${JSON.stringify(name)} is not 1-64 letters, digits, . _ -`)
  const roles = checkRoles(options.roles ?? ['ingress', 'worker'])
  const { notBefore, notAfter } = validityOf(options)
  const ca = await loadCa(caDir)
  return await withRegistry(caDir, false, async (db) => {
    if (await db.get(`node:${name}`) !== undefined) throw new CaError('name-taken', `node ${name} was already issued by this CA; pick another name`)
    if (await db.get(`key:${name}`) !== undefined) throw new CaError('name-taken', `${name} is already the name of a client key of this CA; pick another name`)
    if (await exists(outDir)) throw new CaError('out-exists', `${outDir} already exists; refusing to overwrite`)
    const key = await generateKeyPair('Ed25519')
    const peerId = peerIdFromPrivateKey(key).toString()
    const certificate = createNodeCertificate(ca.secretKey, ca.certificate, { name, peerId, publicKey: key.publicKey.raw, roles, notBefore, notAfter })
    await mkdir(dirname(outDir), { recursive: true })
    try {
      await mkdir(outDir, { mode: 0o700 })
    } catch (err) {
      throw new CaError('out-exists', `${outDir} cannot be created (${(err as { code?: string }).code ?? 'error'})`)
    }
    try {
      await writePrivateKeyFile(join(outDir, 'node.key'), key)
      await writeJsonAtomic(join(outDir, 'node.cert.json'), certificate)
      await writeJsonAtomic(join(outDir, 'ca.cert.json'), ca.certificate)
      const { body } = certificate
      await db.put(`node:${name}`, {
        name, serial: body.serial, peerId, roles, notBefore: body.notBefore, notAfter: body.notAfter, issuedAt: toTimestamp(new Date()), certificate,
      })
    } catch (err) {
      await rm(outDir, { recursive: true, force: true }).catch(() => {})
      throw err
    }
    return { peerId, certificate }
  })
}

/**
 * Issues a client API key named `name` (names are shared with nodes, so `revoke --name` is never
 * ambiguous); returns its bearer token. The registry keeps its serial and validity, not the token.
 */
export async function issueKey (caDir: string, options: { name: string, days?: number, notBefore?: Date, notAfter?: Date }): Promise<{ token: string, key: ClientKey }> {
  const { name } = options
  if (!isValidName(name)) throw new CaError('bad-option', `key name ${JSON.stringify(name)} is not 1-64 letters, digits, . _ -`)
  const { notBefore, notAfter } = validityOf(options)
  const ca = await loadCa(caDir)
  return await withRegistry(caDir, false, async (db) => {
    if (await db.get(`key:${name}`) !== undefined) throw new CaError('name-taken', `client key ${name} was already issued by this CA; pick another name`)
    if (await db.get(`node:${name}`) !== undefined) throw new CaError('name-taken', `${name} is already the name of a node of this CA; pick another name`)
    const key = createClientKey(ca.secretKey, ca.certificate, { name, notBefore, notAfter })
    await db.put(`key:${name}`, { name, serial: key.body.serial, notBefore: key.body.notBefore, notAfter: key.body.notAfter, issuedAt: toTimestamp(new Date()) })
    return { token: encodeClientKey(key), key }
  })
}

/** Puts node (or client key) `name`'s serial on a new revocation list (number + 1). Revoking twice changes nothing. */
export async function revokeNode (caDir: string, name: string): Promise<RevocationList> {
  const ca = await loadCa(caDir)
  return await withRegistry(caDir, false, async (db) => {
    const entry = await db.get(`node:${name}`) ?? await db.get(`key:${name}`)
    if (entry === undefined) throw new CaError('unknown-node', `this CA has not issued a node named ${JSON.stringify(name)} (nor a client key)`)
    const current = await loadRevocations(caDir, ca.certificate)
    if (current.body.revoked.includes(entry.serial)) return current
    const next = createRevocationList(ca.secretKey, ca.certificate, {
      number: current.body.number + 1, revoked: [...current.body.revoked, entry.serial], issuedAt: new Date(),
    })
    await writeJsonAtomic(paths(caDir).revocations, next)
    return parseRevocationList(ca.certificate, next)
  })
}

/** Everything this CA issued, by name. */
export async function listNodes (caDir: string): Promise<NodeListing[]> {
  const ca = await loadCa(caDir)
  return await withRegistry(caDir, false, async (db) => {
    const revoked = new Set((await loadRevocations(caDir, ca.certificate)).body.revoked)
    const out: NodeListing[] = []
    for await (const value of db.values({ gte: 'node:', lt: 'node;' })) {
      const entry = value as RegistryEntry
      out.push({ name: entry.name, peerId: entry.peerId, serial: entry.serial, roles: entry.roles, notAfter: entry.notAfter, revoked: revoked.has(entry.serial) })
    }
    return out.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
  })
}

/** Every client key this CA issued, by name. */
export async function listKeys (caDir: string): Promise<KeyListing[]> {
  const ca = await loadCa(caDir)
  return await withRegistry(caDir, false, async (db) => {
    const revoked = new Set((await loadRevocations(caDir, ca.certificate)).body.revoked)
    const out: KeyListing[] = []
    for await (const value of db.values({ gte: 'key:', lt: 'key;' })) {
      const entry = value as KeyEntry
      out.push({ name: entry.name, serial: entry.serial, notAfter: entry.notAfter, revoked: revoked.has(entry.serial) })
    }
    return out.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
  })
}

/** The CA's current revocation list, checked. */
export async function readCaRevocations (caDir: string): Promise<RevocationList> {
  const ca = await loadCa(caDir)
  return await loadRevocations(caDir, ca.certificate)
}
