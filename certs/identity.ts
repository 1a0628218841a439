/**
 * A node's side: its identity directory (`node.key`, `node.cert.json`, `ca.cert.json`) and the
 * revocation list file it keeps (the newest it has seen).
 */
import { join } from 'node:path'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import type { PrivateKey } from '@libp2p/interface'
import { CertificateError, type RefusalReason } from './errors.ts'
import { readJsonFile, readPrivateKeyFile, seedOf, writeJsonAtomic } from './files.ts'
import type { CaCertificate, NodeCertificate, RevocationList } from './schema.ts'
import { isNewerRevocationList, parseCaCertificate, parseRevocationList, verifyNodeCertificate } from './verify.ts'

export interface NodeIdentity {
  name: string
  peerId: string
  /** The libp2p private key: pass it to createLibp2p({ privateKey }). */
  privateKey: PrivateKey
  /** Raw 32-byte ed25519 seed of the same key, for signDocument (receipts, capability records). */
  secretKey: Uint8Array
  certificate: NodeCertificate
  caCertificate: CaCertificate
}

/**
 * Loads and checks an identity directory: the key file is private, the certificate is signed by
 * the CA certificate beside it, currently valid, and names this key's peer id.
 * Throws CertificateError (code SHOAL_ERR_CERT_<REASON> or SHOAL_ERR_CERT_FILE).
 */
export async function loadIdentity (dir: string, options: { now?: number } = {}): Promise<NodeIdentity> {
  const privateKey = await readPrivateKeyFile(join(dir, 'node.key'))
  const caCertificate = parseCaCertificate(await readJsonFile(join(dir, 'ca.cert.json')))
  const peerId = peerIdFromPrivateKey(privateKey).toString()
  const admission = verifyNodeCertificate({
    caCertificate, certificate: await readJsonFile(join(dir, 'node.cert.json')), peerId, now: options.now,
  })
  if (!admission.admitted) {
    const why: Partial<Record<RefusalReason, string>> = { 'peer-id-mismatch': 'does not belong to node.key' }
    throw new CertificateError(admission.reason, `identity ${dir}: node.cert.json ${why[admission.reason] ?? 'is not valid'}: ${admission.detail}`)
  }
  const certificate = admission.certificate
  return { name: certificate.body.name, peerId, privateKey, secretKey: seedOf(privateKey), certificate, caCertificate }
}

/** Reads a CA certificate file (`ca.cert.json`) and checks its self-signature. Throws CertificateError. */
export async function readCaCertificateFile (file: string): Promise<CaCertificate> {
  const doc = await readJsonFile(file)
  try {
    return parseCaCertificate(doc)
  } catch (err) {
    if (err instanceof CertificateError && err.reason !== undefined) throw new CertificateError(err.reason, `${file}: ${err.message}`)
    throw err
  }
}

/** Reads a revocation list file and checks it against the CA. Throws CertificateError. */
export async function readRevocationFile (file: string, caCertificate: CaCertificate): Promise<RevocationList> {
  const doc = await readJsonFile(file)
  try {
    return parseRevocationList(caCertificate, doc)
  } catch (err) {
    if (err instanceof CertificateError && err.reason !== undefined) throw new CertificateError(err.reason, `${file}: ${err.message}`)
    throw err
  }
}

/** Writes a revocation list atomically (temp file + rename). */
export async function writeRevocationFile (file: string, list: RevocationList): Promise<void> {
  await writeJsonAtomic(file, list)
}

/**
 * Keeps `file` at the newest list: writes `candidate` (already checked against the CA) when it is
 * newer than `current`; returns the list now in force. For lists arriving through the mesh.
 */
export async function keepNewestRevocationList (file: string, candidate: RevocationList, current: RevocationList | undefined): Promise<RevocationList> {
  if (!isNewerRevocationList(candidate, current)) return current as RevocationList
  await writeRevocationFile(file, candidate)
  return candidate
}
