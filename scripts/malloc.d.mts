// Types for scripts/malloc.mjs (plain JS: scripts/shoal.mjs loads it on any Node).
export declare const ENGINE_COMMANDS: Set<string>
export declare const MALLOC_TUNABLES: string
export declare function mallocEnv (args: readonly string[], env: Record<string, string | undefined>, runtime: { platform: string, glibc: string | undefined }): Record<string, string | undefined> | undefined
export declare function glibcVersion (): string | undefined
export declare function execWithMallocTunables (script: string, args: readonly string[]): void
