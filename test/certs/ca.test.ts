// The operator CA on disk: real files, real level registry, real libp2p keys.
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { chmod, copyFile, mkdir, mkdtemp, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import {
  createThrowawayCa, initCa, issueNode, keepNewestRevocationList, listNodes, loadIdentity, publicKeyOf, readCaRevocations,
  readRevocationFile, revokeNode, signDocument, toBase64url, verifyDocument, verifyNodeCertificate, writeRevocationFile,
} from '../../certs/index.ts'

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-ca-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const mode = async (file: string): Promise<number> => (await stat(file)).mode & 0o777
const err = (fields: Record<string, unknown>) => expect.objectContaining(fields)

describe('CA directory', () => {
  it('init writes a 0600 key, a self-signed certificate, list #0 and a registry; a second init touches nothing', async () => {
    const dir = join(root, 'ca1')
    const cert = await initCa(dir, { name: 'ops' })
    expect((await readdir(dir)).sort()).toEqual(['ca.cert.json', 'ca.key', 'registry', 'revocations.json'])
    expect(await mode(join(dir, 'ca.key'))).toBe(0o600)
    expect(JSON.parse(await readFile(join(dir, 'ca.cert.json'), 'utf8'))).toEqual(cert)
    expect((await readCaRevocations(dir)).body).toMatchObject({ number: 0, revoked: [] })
    const before = await Promise.all(['ca.key', 'ca.cert.json', 'revocations.json'].map(async (f) => [await readFile(join(dir, f)), (await stat(join(dir, f))).mtimeMs]))
    await expect(initCa(dir)).rejects.toThrow(err({ name: 'CaError', code: 'SHOAL_ERR_CA_EXISTS' }))
    const after = await Promise.all(['ca.key', 'ca.cert.json', 'revocations.json'].map(async (f) => [await readFile(join(dir, f)), (await stat(join(dir, f))).mtimeMs]))
    expect(after).toEqual(before)
    await mkdir(join(root, 'busy-dir'))
    await writeFile(join(root, 'busy-dir', 'notes.txt'), 'x')
    await expect(initCa(join(root, 'busy-dir'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_EXISTS' }))
    await expect(initCa(join(root, 'bad-name'), { name: 'no spaces' })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_BAD_OPTION' }))
  })

  it('issues identities that load, whose key is the certified libp2p key, and refuses misuse', async () => {
    const dir = join(root, 'ca2')
    const caCert = await initCa(dir)
    const out = join(root, 'ids', 'alpha')
    const { peerId, certificate } = await issueNode(dir, { name: 'alpha', outDir: out, roles: ['worker'], days: 10 })
    expect((await readdir(out)).sort()).toEqual(['ca.cert.json', 'node.cert.json', 'node.key'])
    expect(await mode(join(out, 'node.key'))).toBe(0o600)
    const id = await loadIdentity(out)
    expect(id).toMatchObject({ name: 'alpha', peerId, certificate, caCertificate: caCert })
    expect(peerIdFromPrivateKey(id.privateKey as never).toString()).toBe(peerId)
    expect(toBase64url(publicKeyOf(id.secretKey))).toBe(certificate.body.publicKey)
    expect(verifyDocument(signDocument({ hello: 1 }, id.secretKey), publicKeyOf(id.secretKey))).toBe(true)
    expect(Date.parse(certificate.body.notAfter) - Date.parse(certificate.body.notBefore)).toBe(10 * 86_400_000)

    await expect(issueNode(dir, { name: 'alpha', outDir: join(root, 'ids', 'x') })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_NAME_TAKEN' }))
    await expect(issueNode(dir, { name: 'beta', outDir: out })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_OUT_EXISTS' }))
    await expect(issueNode(dir, { name: 'beta', outDir: join(root, 'ids', 'b'), roles: ['admin' as never] })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_BAD_OPTION' }))
    await expect(issueNode(dir, { name: 'beta', outDir: join(root, 'ids', 'b'), roles: [] })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_BAD_OPTION' }))
    await expect(issueNode(dir, { name: 'beta', outDir: join(root, 'ids', 'b'), days: 0 })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_BAD_OPTION' }))
    await expect(issueNode(join(root, 'nope'), { name: 'beta', outDir: join(root, 'ids', 'b') })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_NOT_FOUND' }))
    await expect(issueNode(dir, { name: '../etc', outDir: join(root, 'ids', 'b') })).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_BAD_OPTION' }))
    expect((await listNodes(dir)).map((n) => n.name)).toEqual(['alpha'])
  })

  it('loadIdentity refuses a readable key, a swapped key, an expired or future certificate, and missing files', async () => {
    const dir = join(root, 'ca3')
    await initCa(dir)
    const ids = join(root, 'ids3')
    await issueNode(dir, { name: 'a', outDir: join(ids, 'a') })
    await issueNode(dir, { name: 'b', outDir: join(ids, 'b') })
    await issueNode(dir, { name: 'old', outDir: join(ids, 'old'), notBefore: new Date(Date.now() - 10 * 86_400_000), notAfter: new Date(Date.now() - 86_400_000) })
    await issueNode(dir, { name: 'new', outDir: join(ids, 'new'), notBefore: new Date(Date.now() + 86_400_000) })
    await expect(loadIdentity(join(ids, 'old'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_EXPIRED' }))
    await expect(loadIdentity(join(ids, 'new'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_NOT_YET_VALID' }))
    await rm(join(ids, 'a', 'node.key'))
    await copyFile(join(ids, 'b', 'node.key'), join(ids, 'a', 'node.key'))
    await expect(loadIdentity(join(ids, 'a'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_PEER_ID_MISMATCH' }))
    await chmod(join(ids, 'b', 'node.key'), 0o644)
    await expect(loadIdentity(join(ids, 'b'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_FILE' }))
    await expect(loadIdentity(join(ids, 'missing'))).rejects.toThrow(err({ name: 'CertificateError', code: 'SHOAL_ERR_CERT_FILE' }))
    await writeFile(join(ids, 'new', 'node.cert.json'), '{not json')
    await expect(loadIdentity(join(ids, 'new'))).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_MALFORMED' }))
  })

  it('revokes by name with increasing list numbers; list shows it; nodes keep the newest list', async () => {
    const t = await createThrowawayCa(join(root, 'mesh'), ['n1', { name: 'n2', roles: ['worker'] }, 'n3'])
    expect(t.identities.map((i) => i.name)).toEqual(['n1', 'n2', 'n3'])
    for (const a of t.identities) {
      for (const b of t.identities) {
        expect(verifyNodeCertificate({ caCertificate: a.caCertificate, certificate: b.certificate, peerId: b.peerId }).admitted).toBe(true)
      }
    }
    const [n1, n2] = t.identities as [typeof t.identities[0], typeof t.identities[0]]
    const l1 = await revokeNode(t.caDir, 'n2')
    expect(l1.body).toMatchObject({ number: 1, revoked: [n2.certificate.body.serial] })
    expect(await revokeNode(t.caDir, 'n2')).toEqual(l1)
    await expect(revokeNode(t.caDir, 'zz')).rejects.toThrow(err({ code: 'SHOAL_ERR_CA_UNKNOWN_NODE' }))
    const listing = await listNodes(t.caDir)
    expect(listing.map((n) => [n.name, n.revoked, n.roles.join(',')])).toEqual([['n1', false, 'ingress,worker'], ['n2', true, 'worker'], ['n3', false, 'ingress,worker']])
    expect(listing[0]).toMatchObject({ peerId: n1.peerId, serial: n1.certificate.body.serial, notAfter: n1.certificate.body.notAfter })
    expect(verifyNodeCertificate({ caCertificate: t.caCertificate, revocations: l1, certificate: n2.certificate, peerId: n2.peerId })).toMatchObject({ reason: 'revoked' })

    // Concurrent operations on one CA either succeed or refuse as busy; numbers never collide.
    const results = await Promise.allSettled([revokeNode(t.caDir, 'n1'), revokeNode(t.caDir, 'n3')])
    for (const r of results) if (r.status === 'rejected') expect(r.reason).toMatchObject({ code: 'SHOAL_ERR_CA_BUSY' })
    const l2 = await readCaRevocations(t.caDir)
    expect(l2.body.number).toBe(1 + results.filter((r) => r.status === 'fulfilled').length)

    const file = join(n1.dir, 'revocations.json')
    expect(await keepNewestRevocationList(file, l1, undefined)).toBe(l1)
    expect(await keepNewestRevocationList(file, l2, l1)).toBe(l2)
    expect(await keepNewestRevocationList(file, l1, l2)).toBe(l2)
    expect(await readRevocationFile(file, t.caCertificate)).toEqual(l2)
    await writeRevocationFile(file, l1)
    expect(await readRevocationFile(file, t.caCertificate)).toEqual(l1)
    expect((await readdir(n1.dir)).filter((f) => f.endsWith('.tmp'))).toEqual([])
    const foreign = await createThrowawayCa(join(root, 'other'), [])
    await expect(readRevocationFile(file, foreign.caCertificate)).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_WRONG_CA' }))
    await expect(readRevocationFile(join(root, 'none.json'), t.caCertificate)).rejects.toThrow(err({ code: 'SHOAL_ERR_CERT_FILE' }))
  })
})
