/**
 * The npm side of a fresh clone: no npm command warns about the project's config, and a plain
 * `npm ci` accepts the lockfile (it needs every platform's optional packages listed, not only
 * this machine's). `npm ci --dry-run` runs the same lockfile check without installing anything.
 */
import { spawnSync } from 'node:child_process'
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { delimiter, dirname, join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'

const REPO = join(import.meta.dirname, '..', '..')
const env = { ...process.env, PATH: [dirname(process.execPath), process.env.PATH].join(delimiter) }
const tmp = mkdtempSync(join(tmpdir(), 'shoal-npm-'))
afterAll(() => { rmSync(tmp, { recursive: true, force: true }) })

describe('npm in this repository', () => {
  it('warns about no unknown project config', () => {
    const r = spawnSync('npm', ['pkg', 'get', 'name'], { cwd: REPO, env, encoding: 'utf8' })
    expect(r.status, r.stderr).toBe(0)
    expect(r.stdout.trim()).toBe('"shoal"')
    expect(r.stderr).not.toMatch(/Unknown (project|env|user) config/)
  })

  it('plain npm ci accepts the lockfile', () => {
    for (const f of ['package.json', 'package-lock.json', '.npmrc']) copyFileSync(join(REPO, f), join(tmp, f))
    const r = spawnSync('npm', ['ci', '--dry-run', '--ignore-scripts', '--no-audit', '--no-fund'], { cwd: tmp, env, encoding: 'utf8', timeout: 120_000 })
    expect(r.status, r.stderr).toBe(0)
  }, 120_000)
})
