// certs/README.md's worked example is what the code produces, byte for byte.
import { describe, expect, it } from 'vitest'
import { readFile } from 'node:fs/promises'
import { createHash } from 'node:crypto'
import { verifyNodeCertificate } from '../../certs/index.ts'
import { workedExample } from '../../certs/example.ts'

describe('README worked example', () => {
  it('holds the real certificates, signed text and hash', async () => {
    const readme = await readFile(new URL('../../certs/README.md', import.meta.url), 'utf8')
    const ex = await workedExample()
    expect(readme).toContain(JSON.stringify(ex.caCertificate))
    expect(readme).toContain(JSON.stringify(ex.nodeCertificate))
    expect(readme).toContain(`\n${ex.signedText}\n`)
    expect(readme).toContain(ex.signedBytesSha256)
    expect(createHash('sha256').update(ex.signedText).digest('hex')).toBe(ex.signedBytesSha256)
    expect(readme).toContain(`these ${Buffer.byteLength(ex.signedText)} bytes`)
    const admission = verifyNodeCertificate({
      caCertificate: ex.caCertificate, certificate: ex.nodeCertificate, peerId: ex.nodeCertificate.body.peerId, now: Date.parse('2027-01-01T00:00:00Z'),
    })
    expect(admission.admitted).toBe(true)
  })
})
