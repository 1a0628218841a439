/**
 * The README's "A mesh of your own" block, run as written: the real `bin/shoal` on PATH, in a
 * directory holding `./my-model` (a random-weight 24-layer checkpoint, tiny otherwise), each line
 * through `sh -c`. The two `shoal node` lines keep running (each stands for a machine); the rest
 * must exit 0. The only change is a free port for 8080. The nodes are given no addresses: they
 * must listen by default and find each other by mDNS, and the API must serve the 2-stage chain.
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { delimiter, dirname, join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { generateTestModel } from '../../shards/index.ts'
import { freePort, waitFor } from './daemon.ts'

const REPO = join(import.meta.dirname, '..', '..')

/** The shell lines of the README block that follows `<!-- test/e2e/readme-mesh.test.ts … -->`. */
export async function readmeMeshLines (): Promise<string[]> {
  const readme = await readFile(join(REPO, 'README.md'), 'utf8')
  const marker = readme.indexOf('<!-- test/e2e/readme-mesh.test.ts')
  if (marker < 0) throw new Error('README.md has no block marked for test/e2e/readme-mesh.test.ts')
  const block = /```sh\n([\s\S]*?)```/.exec(readme.slice(marker))![1]!
  return block.replace(/\\\n\s*/g, '').split('\n').filter(l => l.trim() !== '' && !l.trim().startsWith('#'))
}

interface Run { line: string, child: ChildProcess, out: () => string, exit: Promise<number | null> }

describe('README: a mesh of your own', () => {
  let cwd: string
  const runs: Run[] = []
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    PATH: [join(REPO, 'bin'), dirname(process.execPath), process.env.PATH].join(delimiter),
    SHOAL_LOG_LEVEL: 'warn',
  }

  beforeAll(async () => {
    cwd = await mkdtemp(join(tmpdir(), 'shoal-readme-'))
    env.SHOAL_CACHE = join(cwd, '.cache')
    await generateTestModel({ architecture: 'llama', size: 'tiny', layers: 24, outDir: join(cwd, 'my-model'), seed: 4 })
  })
  afterAll(async () => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL')
    await rm(cwd, { recursive: true, force: true })
  })

  const start = (line: string): Run => {
    // `exec` so that a signal to the child reaches the shoal process itself, not a waiting shell.
    const child = spawn('sh', ['-c', `exec ${line}`], { cwd, env, stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    child.stdout!.setEncoding('utf8').on('data', (s: string) => { out += s })
    child.stderr!.setEncoding('utf8').on('data', (s: string) => { out += s })
    const exit = new Promise<number | null>(resolve => child.once('exit', code => { resolve(code) }))
    const run = { line, child, out: () => out, exit }
    runs.push(run)
    return run
  }

  it('forms a mesh from nodes given no addresses and serves a 2-stage chain', async () => {
    const port = await freePort()
    const lines = (await readmeMeshLines()).map(l => l.replaceAll('127.0.0.1:8080', `127.0.0.1:${port}`))
    expect(lines.filter(l => l.startsWith('shoal node '))).toHaveLength(2)
    const api = `http://127.0.0.1:${port}`
    let nodesUp = 0
    const outputs: string[] = []
    for (const line of lines) {
      if (line.startsWith('shoal receipts ')) {
        // "after stopping its node (Ctrl-C)": the node holding that --data stops cleanly first.
        const data = /--data (\S+)/.exec(line)![1]!
        const node = runs.find(r => r.line.startsWith('shoal node ') && r.line.includes(`--data ${data}`))!
        node.child.kill('SIGINT')
        expect(await node.exit, node.out()).toBe(0)
      }
      const run = start(line)
      if (line.startsWith('shoal node ')) {
        // A daemon: running once it prints where it listens (and the API, if it has one).
        await waitFor(`"${line}" to start`, async () => {
          if (run.child.exitCode !== null) throw new Error(`"${line}" exited ${run.child.exitCode}: ${run.out()}`)
          return /data in /.test(run.out())
        }, 60_000)
        expect(run.out()).toMatch(/listening on \/ip4\/127\.0\.0\.1\/udp\/\d+\/quic-v1/)
        expect(run.out()).toMatch(/listening on \/ip4\/127\.0\.0\.1\/tcp\/\d+/)
        if (++nodesUp === 2) {
          // The README's "once the nodes have found each other": the chain is listed when complete.
          await waitFor('the 2-stage chain to be listed', async () => {
            const res = await fetch(`${api}/v1/models`).catch(() => undefined)
            if (res?.ok !== true) return false
            return ((await res.json()) as { data: Array<{ id: string }> }).data.some(m => m.id === 'my-model')
          }, 30_000)
        }
        continue
      }
      const code = await run.exit
      expect(code, `"${line}" failed: ${run.out()}`).toBe(0)
      outputs.push(run.out())
    }
    const [, issued1, issued2, sharded, status, completion, verified] = outputs
    const peer1 = issued1!.trim()
    const peer2 = issued2!.trim()
    expect(sharded).toContain('[0-11, 12-23]')
    expect(status).toMatch(new RegExp(`node-1\\s+${peer1}\\s+admitted\\s+my-model@0-11`))
    expect(status).toMatch(new RegExp(`node-2\\s+${peer2}\\s+admitted\\s+my-model@12-23`))
    const body = JSON.parse(completion!) as { choices: Array<{ finish_reason: string }>, usage: { completion_tokens: number }, shoal: { route: string[] } }
    expect(body.choices[0]!.finish_reason).toBe('length')
    expect(body.usage.completion_tokens).toBe(16)
    expect(body.shoal.route).toEqual([peer1, peer2])
    expect(verified).toMatch(/^ok: 1 entries/)
    expect(verified).toContain(`ca: every signer`)
  }, 180_000)
})
