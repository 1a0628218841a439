/**
 * On-disk forms: private keys (libp2p protobuf encoding, mode 0600, created exclusively, never
 * printed) and JSON documents (written atomically: temp file + rename). Reads are size-capped and
 * fail with a CertificateError naming the file, never with the raw fs error alone.
 */
import { chmod, open, readFile, rename, rm, stat, writeFile } from 'node:fs/promises'
import { randomBytes } from 'node:crypto'
import { privateKeyFromProtobuf, privateKeyToProtobuf } from '@libp2p/crypto/keys'
import type { Ed25519PrivateKey } from '@libp2p/interface'
import { CertificateError } from './errors.ts'

const MAX_KEY_FILE = 4096
export const MAX_DOCUMENT_FILE = 4 * 1024 * 1024

function fsReason (err: unknown): string {
  const code = (err as { code?: unknown } | null)?.code
  if (code === 'ENOENT') return 'does not exist'
  if (code === 'EACCES' || code === 'EPERM') return 'is not readable (permission denied)'
  if (code === 'EISDIR') return 'is a directory'
  return `cannot be read (${typeof code === 'string' ? code : 'error'})`
}

/** The raw 32-byte ed25519 seed of a libp2p Ed25519 private key (its `raw` is seed ‖ public key). */
export function seedOf (key: Ed25519PrivateKey): Uint8Array {
  return key.raw.slice(0, 32)
}

/** Creates `file` (must not exist) holding the key, mode 0600. */
export async function writePrivateKeyFile (file: string, key: Ed25519PrivateKey): Promise<void> {
  const handle = await open(file, 'wx', 0o600)
  try {
    await handle.chmod(0o600) // the umask may only have narrowed it; make it exactly 0600
    await handle.writeFile(privateKeyToProtobuf(key))
    await handle.sync()
  } finally {
    await handle.close()
  }
}

/** Reads an Ed25519 private key file; refuses one that others can read (as ssh does). */
export async function readPrivateKeyFile (file: string): Promise<Ed25519PrivateKey> {
  let bytes: Uint8Array
  try {
    const info = await stat(file)
    if (!info.isFile()) throw new CertificateError('file', `${file} is not a file`)
    if (info.size > MAX_KEY_FILE) throw new CertificateError('file', `${file} is too large to be a key`)
    if (process.platform !== 'win32' && (info.mode & 0o077) !== 0) {
      throw new CertificateError('file', `${file} is accessible by others (mode ${(info.mode & 0o777).toString(8)}); run: chmod 600 ${file}`)
    }
    bytes = await readFile(file)
  } catch (err) {
    if (err instanceof CertificateError) throw err
    throw new CertificateError('file', `${file} ${fsReason(err)}`, { cause: err })
  }
  let key
  try {
    key = privateKeyFromProtobuf(bytes)
  } catch {
    throw new CertificateError('malformed', `${file} is not a libp2p private key`)
  }
  if (key.type !== 'Ed25519') throw new CertificateError('malformed', `${file} holds a ${key.type} key, not Ed25519`)
  return key
}

/** Writes JSON via a temp file in the same directory and a rename, so readers see old or new. */
export async function writeJsonAtomic (file: string, value: unknown, mode = 0o644): Promise<void> {
  const temp = `${file}.${randomBytes(6).toString('hex')}.tmp`
  try {
    await writeFile(temp, `${JSON.stringify(value, null, 2)}\n`, { mode, flag: 'wx', flush: true })
    await chmod(temp, mode)
    await rename(temp, file)
  } catch (err) {
    await rm(temp, { force: true }).catch(() => {})
    throw new CertificateError('file', `${file} cannot be written (${(err as { code?: string }).code ?? 'error'})`, { cause: err })
  }
}

/** Reads and JSON-parses a document file (size-capped). Content checks are the caller's. */
export async function readJsonFile (file: string, maxBytes = MAX_DOCUMENT_FILE): Promise<unknown> {
  let text: string
  try {
    const info = await stat(file)
    if (!info.isFile()) throw new CertificateError('file', `${file} is not a file`)
    if (info.size > maxBytes) throw new CertificateError('malformed', `${file} is larger than ${maxBytes} bytes`)
    text = await readFile(file, 'utf8')
  } catch (err) {
    if (err instanceof CertificateError) throw err
    throw new CertificateError('file', `${file} ${fsReason(err)}`, { cause: err })
  }
  try {
    return JSON.parse(text)
  } catch {
    throw new CertificateError('malformed', `${file} is not JSON`)
  }
}
