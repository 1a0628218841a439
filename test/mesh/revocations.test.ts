/** The revocation list in force: newest wins, invalid lists are refused, the file follows. */
import { mkdir, readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { createThrowawayCa, issueNode, revokeNode } from '../../certs/index.ts'
import { RevocationState } from '../../daemon/mesh/revocations.ts'
import { tempDir } from './helpers.ts'

describe('RevocationState', () => {
  let cleanup: (() => Promise<void>) | undefined
  afterAll(async () => { await cleanup?.() })

  it('adopts only newer valid lists of its CA and persists them', async () => {
    const t = await tempDir('revocations')
    cleanup = t.cleanup
    const ca = await createThrowawayCa(t.dir, ['a'])
    const other = await createThrowawayCa(join(t.dir, 'other'), ['z'])
    await issueNode(ca.caDir, { name: 'x', outDir: join(t.dir, 'x') })
    await issueNode(ca.caDir, { name: 'y', outDir: join(t.dir, 'y') })
    const first = await revokeNode(ca.caDir, 'x')
    const second = await revokeNode(ca.caDir, 'y')
    const file = join(t.dir, 'data', 'revocations.json')
    await mkdir(join(t.dir, 'data'))
    const state = new RevocationState(ca.caCertificate, file, err => { throw err })
    await state.load()
    expect(state.current).toBeUndefined()

    expect(state.offer(second)).toMatchObject({ adopted: true })
    expect(state.offer(first)).toEqual({ adopted: false, why: 'not-newer' })
    expect(state.offer(second)).toEqual({ adopted: false, why: 'not-newer' })
    expect(state.offer(await revokeNode(other.caDir, 'z'))).toMatchObject({ adopted: false, why: 'invalid', code: 'SHOAL_ERR_CERT_WRONG_CA' })
    expect(state.offer({ body: {}, signature: 'x' })).toMatchObject({ adopted: false, why: 'invalid' })
    expect(state.revokedSerials.size).toBe(2)
    await state.flush()
    expect(JSON.parse(await readFile(file, 'utf8'))).toEqual(second)

    const reloaded = new RevocationState(ca.caCertificate, file, err => { throw err })
    await reloaded.load()
    expect(reloaded.current?.body.number).toBe(second.body.number)
  })
})
