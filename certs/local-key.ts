/**
 * A node key without a certificate, for `shoal serve` (one machine, no mesh): receipts still need
 * a stable signer, and its peer id embeds the public key so receipts verify without a CA.
 */
import { mkdir, stat } from 'node:fs/promises'
import { dirname } from 'node:path'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import type { Ed25519PrivateKey } from '@libp2p/interface'
import { readPrivateKeyFile, seedOf, writePrivateKeyFile } from './files.ts'

export interface LocalKey {
  peerId: string
  privateKey: Ed25519PrivateKey
  secretKey: Uint8Array
}

/** Reads `file`, or creates it (mode 0600) when it does not exist yet. */
export async function loadOrCreateNodeKey (file: string): Promise<LocalKey> {
  let privateKey: Ed25519PrivateKey
  if (await exists(file)) {
    privateKey = await readPrivateKeyFile(file)
  } else {
    await mkdir(dirname(file), { recursive: true })
    privateKey = await generateKeyPair('Ed25519')
    try {
      await writePrivateKeyFile(file, privateKey)
    } catch (writeErr) {
      // Another process created it first: use theirs.
      if ((writeErr as { code?: string }).code !== 'EEXIST') throw writeErr
      privateKey = await readPrivateKeyFile(file)
    }
  }
  return { peerId: peerIdFromPrivateKey(privateKey).toString(), privateKey, secretKey: seedOf(privateKey) }
}

async function exists (file: string): Promise<boolean> {
  try {
    await stat(file)
    return true
  } catch (err) {
    if ((err as { code?: string }).code === 'ENOENT') return false
    throw err
  }
}
