/**
 * The worked example of certs/README.md, made by the real code from fixed seeds and times, so the
 * README's values can be regenerated (`node certs/example.ts`) and are checked by a test.
 * Not part of the public surface; never use these keys for anything.
 */
import { sha256 } from '@noble/hashes/sha2.js'
import { generateKeyPairFromSeed } from '@libp2p/crypto/keys'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import { canonicalBytes } from './signed.ts'
import { createCaCertificate, createNodeCertificate } from './issue.ts'
import type { CaCertificate, NodeCertificate } from './schema.ts'

export interface WorkedExample {
  caCertificate: CaCertificate
  nodeCertificate: NodeCertificate
  /** The exact signed text: JCS of the node certificate's body. */
  signedText: string
  signedBytesSha256: string
}

export async function workedExample (): Promise<WorkedExample> {
  const caSeed = sha256(new TextEncoder().encode('shoal worked example CA'))
  const nodeKey = await generateKeyPairFromSeed('Ed25519', sha256(new TextEncoder().encode('shoal worked example node')))
  const caCertificate = createCaCertificate(caSeed, {
    name: 'example-ca', notBefore: new Date('2025-01-01T00:00:00Z'), notAfter: new Date('2035-01-01T00:00:00Z'),
  })
  const nodeCertificate = createNodeCertificate(caSeed, caCertificate, {
    name: 'laptop-1',
    peerId: peerIdFromPrivateKey(nodeKey).toString(),
    publicKey: nodeKey.publicKey.raw,
    roles: ['ingress', 'worker'],
    notBefore: new Date('2025-01-01T00:00:00Z'),
    notAfter: new Date('2030-01-01T00:00:00Z'),
    serial: '00112233445566778899aabbccddeeff',
  })
  const bytes = canonicalBytes(nodeCertificate.body)
  return {
    caCertificate,
    nodeCertificate,
    signedText: new TextDecoder().decode(bytes),
    signedBytesSha256: Buffer.from(sha256(bytes)).toString('hex'),
  }
}

if (import.meta.main === true) {
  const ex = await workedExample()
  process.stdout.write(`${JSON.stringify(ex, null, 2)}\n`)
}
