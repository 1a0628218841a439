/**
 * The launcher's glibc malloc settings (scripts/malloc.mjs): which processes re-execute with them
 * and with what environment. The re-execution itself is checked on a running `shoal serve` in
 * test/e2e/cli.test.ts (its /proc environ, same PID).
 */
import { describe, expect, it } from 'vitest'
import { ENGINE_COMMANDS, MALLOC_TUNABLES, mallocEnv } from '../../scripts/malloc.mjs'

const GLIBC = { platform: 'linux', glibc: '2.36' }

describe('mallocEnv', () => {
  it('sets the tunables for every command that runs an engine, keeping the rest of the environment', () => {
    for (const command of ENGINE_COMMANDS) {
      const env = mallocEnv([command, '--model', 'm'], { PATH: '/bin', SHOAL_CACHE: '/c' }, GLIBC)
      expect(env).toEqual({ PATH: '/bin', SHOAL_CACHE: '/c', GLIBC_TUNABLES: MALLOC_TUNABLES })
    }
    expect([...ENGINE_COMMANDS].sort()).toEqual(['demo', 'node', 'serve'])
  })

  it('appends to tunables that set no malloc key', () => {
    const env = mallocEnv(['serve'], { GLIBC_TUNABLES: 'glibc.cpu.hwcaps=-AVX512F' }, GLIBC)
    expect(env?.GLIBC_TUNABLES).toBe(`glibc.cpu.hwcaps=-AVX512F:${MALLOC_TUNABLES}`)
  })

  it('runs as is when malloc is already tuned (the operator, or the re-executed process), off glibc, or for other commands', () => {
    expect(mallocEnv(['serve'], { GLIBC_TUNABLES: 'glibc.malloc.arena_max=2' }, GLIBC)).toBeUndefined()
    expect(mallocEnv(['serve'], { GLIBC_TUNABLES: MALLOC_TUNABLES }, GLIBC)).toBeUndefined()
    expect(mallocEnv(['serve'], {}, { platform: 'linux', glibc: undefined })).toBeUndefined()
    expect(mallocEnv(['serve'], {}, { platform: 'darwin', glibc: undefined })).toBeUndefined()
    for (const args of [['ca', 'init'], ['shard', '--model', 'm'], ['--version'], []]) expect(mallocEnv(args, {}, GLIBC)).toBeUndefined()
  })
})
