/**
 * Pins the bytes of daemon/ledger/README.md's worked example: the same fixed key, clock and request
 * must produce the same hashes and signature (ed25519 is deterministic), and the README must show them.
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { expect, it } from 'vitest'
import { workedExample } from './fixtures/worked-example.ts'

const GOLDEN = {
  peerId: '12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5',
  publicKeyB64u: 'iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w',
  requestHash: '58cf052de638afcbe663a2d57a7f7b27b7db8bf33a9e2c83ecce9c7a3545d56c',
  responseHash: '0581bfdc3efe7f82fa48e8bb60e6742cf32f0750a3d9583693f5caf38f0d489c',
  signature: 'fHC9q3G3Wh85tCf7C8L6o03UIHESJlrVb5jJFqRhJwT2jlQPbSTCWOpi5r8fNLRLcxEnGXeMqqFezERiGUu1Ag',
  entryHash: '854afe7229b5e4903b2a13b9b36431302f8a290ffe6b264cea091b36e146370b',
}

it('the worked example reproduces byte for byte, and the README shows it', async () => {
  const ex = await workedExample()
  expect(ex.peerId).toBe(GOLDEN.peerId)
  expect(ex.publicKeyB64u).toBe(GOLDEN.publicKeyB64u)
  expect(ex.entry.body.requestHash).toBe(GOLDEN.requestHash)
  expect(ex.entry.body.responseHash).toBe(GOLDEN.responseHash)
  expect(ex.entry.signature).toBe(GOLDEN.signature)
  expect(ex.entryHash).toBe(GOLDEN.entryHash)
  const readme = await readFile(join(import.meta.dirname, '../../daemon/ledger/README.md'), 'utf8')
  for (const value of [...Object.values(GOLDEN), ex.bodyJcs, ex.requestContentJcs, ex.responseContentJcs]) expect(readme).toContain(value)
})
