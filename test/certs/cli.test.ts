// `shoal ca …` through the real command table (scripts/cli.ts main), capturing stdout and stderr.
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import { mkdtemp, rm, stat } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { main } from '../../scripts/cli.ts'
import { loadIdentity } from '../../certs/index.ts'

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-ca-cli-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

async function shoal (...argv: string[]): Promise<{ code: number, out: string, err: string }> {
  let out = ''
  let err = ''
  const o = vi.spyOn(process.stdout, 'write').mockImplementation((chunk: string | Uint8Array) => { out += String(chunk); return true })
  const e = vi.spyOn(process.stderr, 'write').mockImplementation((chunk: string | Uint8Array) => { err += String(chunk); return true })
  try {
    return { code: await main(argv), out, err }
  } finally {
    o.mockRestore()
    e.mockRestore()
  }
}

function expectMisuse (r: { code: number, err: string, out: string }, pattern: RegExp): void {
  expect(r.code).toBe(2)
  expect(r.err).toMatch(pattern)
  expect(r.err.trimEnd().split('\n')).toHaveLength(1)
  expect(r.err.startsWith('shoal: ')).toBe(true)
}

describe('shoal ca', () => {
  it('init, issue, revoke, list; and every misuse exits 2 with one line', async () => {
    const ca = join(root, 'ca')
    const init = await shoal('ca', 'init', '--dir', ca)
    expect(init).toMatchObject({ code: 0, err: '' })
    expect((await stat(join(ca, 'ca.key'))).mode & 0o777).toBe(0o600)
    expectMisuse(await shoal('ca', 'init', '--dir', ca), /already holds a CA; refusing to overwrite/)

    const alpha = await shoal('ca', 'issue', '--dir', ca, '--name', 'alpha', '--out', join(root, 'alpha'))
    expect(alpha.code).toBe(0)
    expect(alpha.out).toMatch(/^12D3KooW[1-9A-HJ-NP-Za-km-z]+\n$/)
    expect((await loadIdentity(join(root, 'alpha'))).peerId).toBe(alpha.out.trim())
    const beta = await shoal('ca', 'issue', '--dir', ca, '--name', 'beta', '--out', join(root, 'beta'), '--days', '7', '--roles', 'worker')
    expect(beta.code).toBe(0)
    expect((await loadIdentity(join(root, 'beta'))).certificate.body.roles).toEqual(['worker'])

    const issue = (...extra: string[]) => shoal('ca', 'issue', '--dir', ca, '--name', 'gamma', '--out', join(root, 'gamma'), ...extra)
    for (const days of ['abc', '0', '1.5', '-3', '99999', '']) expectMisuse(await issue('--days', days), /days/)
    for (const roles of ['admin', '', 'worker,worker', 'ingress,,worker']) expectMisuse(await issue('--roles', roles), /role/)
    expectMisuse(await shoal('ca', 'issue', '--dir', ca, '--name', 'alpha', '--out', join(root, 'again')), /already issued/)
    expectMisuse(await shoal('ca', 'issue', '--dir', ca, '--name', 'gamma', '--out', join(root, 'alpha')), /already exists/)
    expectMisuse(await shoal('ca', 'issue', '--dir', join(root, 'nope'), '--name', 'gamma', '--out', join(root, 'g')), /no CA/)
    expectMisuse(await shoal('ca', 'issue', '--dir', ca, '--out', join(root, 'g')), /--name/)
    expectMisuse(await shoal('ca', 'issue', '--dir', ca, '--name', 'g', '--out', join(root, 'g'), '--bogus'), /bogus/)

    expect(await shoal('ca', 'revoke', '--dir', ca, '--name', 'beta')).toMatchObject({ code: 0, err: '' })
    expectMisuse(await shoal('ca', 'revoke', '--dir', ca, '--name', 'delta'), /has not issued a node named "delta"/)
    expectMisuse(await shoal('ca', 'revoke', '--dir', join(root, 'nope'), '--name', 'beta'), /no CA/)

    const list = await shoal('ca', 'list', '--dir', ca)
    expect(list.code).toBe(0)
    const rows = list.out.trimEnd().split('\n').map((r) => r.split(/\s{2,}/))
    expect(rows[0]).toEqual(['NAME', 'PEER ID', 'SERIAL', 'ROLES', 'EXPIRES', 'REVOKED'])
    expect(rows.slice(1).map((r) => [r[0], r[3], r[5]])).toEqual([['alpha', 'ingress,worker', 'no'], ['beta', 'worker', 'yes']])
    expect(rows[1]?.[1]).toBe(alpha.out.trim())
    expectMisuse(await shoal('ca', 'list', '--dir', join(root, 'nope')), /no CA/)
    expect(list.out + init.out + alpha.out).not.toMatch(/key":|PRIVATE/)
  })

  it('has --help for every subcommand', async () => {
    for (const sub of ['init', 'issue', 'revoke', 'list']) {
      const r = await shoal('ca', sub, '--help')
      expect(r.code).toBe(0)
      expect(r.out).toContain('--dir')
    }
  })
})
