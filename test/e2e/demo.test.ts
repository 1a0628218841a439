/**
 * `npm start` (`shoal demo`) as a user runs it, twice: the first run generates and compiles the
 * demo model with progress lines, the second says nothing about it (it is cached); each run says
 * where its data is and keeps it, so the receipts of a completion can be checked after Ctrl-C
 * against the demo's CA.
 */
import { spawn } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { freePort, waitFor } from './daemon.ts'

const BIN = join(import.meta.dirname, '..', '..', 'scripts', 'shoal.mjs')
let cache: string

beforeAll(async () => { cache = await mkdtemp(join(tmpdir(), 'shoal-demo-test-')) })
afterAll(async () => { await rm(cache, { recursive: true, force: true }) })

async function run (args: string[], until?: RegExp): Promise<{ stdout: string, stderr: string, stop: () => Promise<number | null>, exit: Promise<number | null> }> {
  const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, SHOAL_CACHE: cache, SHOAL_LOG_LEVEL: 'warn' }, stdio: ['ignore', 'pipe', 'pipe'] })
  let stdout = ''
  let stderr = ''
  child.stdout.setEncoding('utf8').on('data', (s: string) => { stdout += s })
  child.stderr.setEncoding('utf8').on('data', (s: string) => { stderr += s })
  const exit = new Promise<number | null>(resolve => child.once('exit', code => { resolve(code) }))
  if (until !== undefined) {
    await waitFor(`${args.join(' ')} to print ${until}`, async () => {
      if (child.exitCode !== null) throw new Error(`exited ${child.exitCode}: ${stderr}`)
      return until.test(stdout)
    }, 120_000)
  }
  return {
    get stdout () { return stdout },
    get stderr () { return stderr },
    stop: async () => { child.kill('SIGINT'); return await exit },
    exit,
  }
}

describe('shoal demo (npm start)', () => {
  it('says what it prepares only when it does, and keeps checkable receipts under the cache dir', async () => {
    const port = await freePort()
    const first = await run(['demo', '--nodes', '1', '--port', String(port)], /^then, after Ctrl-C: /m)
    expect(first.stdout).toContain(`shoal: generating the demo model (random weights; once) into ${join(cache, 'models')}`)
    expect(first.stdout).toMatch(/shoal: compiling the demo model into ONNX shards \(once\)/)
    expect(first.stdout).toMatch(/shoal: compiling: 8\/8 layers, done in \d+\.\d s/)
    expect(first.stdout).toContain(`data: ${join(cache, 'demo')} `)
    const res = await fetch(`http://127.0.0.1:${port}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'shoal-demo', messages: [{ role: 'user', content: 'Hello' }], max_tokens: 4 }),
    })
    expect(res.status).toBe(200)
    expect(res.headers.get('x-shoal-receipt')).toMatch(/\S/)
    expect(await first.stop()).toBe(0)

    const verifyLine = /^then, after Ctrl-C: shoal (receipts verify .*)$/m.exec(first.stdout)![1]!
    const verify = await run(verifyLine.split(' '))
    expect(await verify.exit, verify.stderr).toBe(0)
    expect(verify.stdout).toMatch(/^ok: 1 entries/)
    expect(verify.stdout).toContain('ca: every signer')

    const second = await run(['demo', '--nodes', '1', '--port', String(port)], /^then, after Ctrl-C: /m)
    expect(second.stdout).not.toMatch(/generating|compiling|first run/)
    expect(await second.stop()).toBe(0)
    // The same log, one chain across runs.
    const again = await run(verifyLine.split(' '))
    expect(await again.exit, again.stderr).toBe(0)
  }, 240_000)
})
