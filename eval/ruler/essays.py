"""The 49 essays of gkamradt/LLMTest_NeedleInAHaystack that open RULER's ``PaulGrahamEssays.json``, by content.

RULER's download script concatenates, without separators, these essays (read with universal newlines, so the
CRLF line ends they had until 2024-03 read as LF), then the essays it scrapes from paulgraham.com. Since 2024-08-20
it sorts the file names first; before, it took them in the file system's listing order, so an older download holds
the same 49 essays in another order. Each essay is identified by its characters and the SHA-256 of their UTF-8
bytes (``GKAMRADT_ESSAYS``, in sorted order); :func:`essays_opening` reads which of them a text opens with.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

GKAMRADT_ESSAYS: tuple[tuple[str, int, str], ...] = (
    ("addiction.txt", 7436, "32b4b8f14a126a14bb7da5a25fb134601510344d9bd3456bd509c2c14609e102"),
    ("aord.txt", 8501, "ca1a95525193b977ca9e5b4d2523ed6f33ce10272b00fb2e83dfc4df742d7195"),
    ("apple.txt", 12406, "e84fd53a3792f196fd07614ee28d721af98e7425b3b092ab7f02b90fa61e5e84"),
    ("avg.txt", 25387, "0111c10328933b0e90d7a696cb07fa1c89aaf9c773706b28d687a2489384692b"),
    ("before.txt", 25529, "db4bd3fd62ba3c98eeb8822d048ac664742709d4cd6d4dc0c2f9da4af0a9a1f5"),
    ("bias.txt", 3368, "363e55ef481571ab75173229d237491f203d4e7a4f04837bf88bb6bd6cc51e91"),
    ("boss.txt", 14317, "a0b98955ffb64162048538fcc7372c5f51c06e5a11fe1b15826ae737a3d2cd44"),
    ("copy.txt", 5365, "15259f67aa300ccec434b955b1ea100fa23b8d16733adf140da0332c20d63125"),
    ("corpdev.txt", 7086, "c966a343377308ccc11b5bd7f0967f226b89a6f9708d96c709f50913890ca8b2"),
    ("desres.txt", 14988, "3982864276f95b1a606d76f187ce2c0450a3810b9858fd33a61af1489e1a00ae"),
    ("diff.txt", 4231, "281adb331d84feafaf9954aa9f38188a6e30856c19cbcf745eca43c70759952f"),
    ("ecw.txt", 6259, "754e542a397e82bc23b488c3600b5bdb7d285aaf774c6fbfb0e5302ca89dd1df"),
    ("founders.txt", 4542, "b49b61dba29889880d66fb00b52c1c37a9373ba473a61e95a0701eca80beb247"),
    ("foundervisa.txt", 2261, "331d5492353c6207efec65c949fe6c813909fb58f85aa606ba393d021af04d27"),
    ("gap.txt", 32640, "fd753f0535797ac3dff137766ed2a71adc71179bb5cfe4521822b85d8e84e7c5"),
    ("gba.txt", 11455, "aede19c44c7f337eed5e72d28b8a1ff040510662621ff3fbd1301d51e126a9da"),
    ("gh.txt", 29511, "ea1aa69c11b29b298ae5068e3b13bb6a6706c0e2276820f77ee60c2b080ee62c"),
    ("goodtaste.txt", 6051, "5383bdc4bf4ba34d831a700defdfa553c418157b4b75e217f4557e105c79e5b9"),
    ("hubs.txt", 10243, "decb683073e140ef5e0463a93d7d35d74df8518afe61dd10a0a330cb4ba2bcfd"),
    ("iflisp.txt", 2457, "2cc2432a3b4e76bd2c6d643e3c224e73991cc15efed7a7da16baf20898f29f80"),
    ("island.txt", 4068, "ec72fccf5757b92e4d924a734c6be7efed4cbf4c0ea53ca927b9e9a91de0995e"),
    ("know.txt", 3685, "2e1c8e32d5d1157eae192332c88ac7495a858ce2a141be17b0585c22223187d0"),
    ("langdes.txt", 16954, "0fa1ced068a09646c857d91ce8d4685fcedec09ad6ef12b54c6e3013a98d3461"),
    ("laundry.txt", 24563, "546c9f99d47fd89bce653993fa2b476a6e90a76d1d049008ffda438bc7820b87"),
    ("love.txt", 25517, "ec4cde975ab273f5641fae71edefed10761876cafb572fb95a28420e121edc0c"),
    ("mod.txt", 3898, "016034d82e0664036df32ebbcf30566ab6a8a41a13d4e89d8952eebbc36bc81b"),
    ("newideas.txt", 7732, "e680d93042bf45fef78c10924e74a9749e5f25672350dace89e2b52b5d63d131"),
    ("nft.txt", 1742, "9b260edeccefe0c29641f8ff5ef429a56177c1bed20a7cdfc7dd9f3e716c4649"),
    ("philosophy.txt", 27969, "7e0e7ec9443730b0b79aad2ef14d74470a310d8df439d73a82e99ba693f4e091"),
    ("popular.txt", 43269, "ba81fc48f3a6973f44019565f73d8ecf08f9abde99f0ffd10452fd9cb492726b"),
    ("pow.txt", 655, "9544b749d124306337b10b460f53fb7005861f662cbfda719fc886e0d2796166"),
    ("rootsoflisp.txt", 2056, "9d743d2cd576905006a06c4f0e48f0d32196dc63018d09772384ce900651f69b"),
    ("rss.txt", 55, "0c9f488b4334ef61adff51a19308e7da71cfab192ab3df751e3ad3f64b948411"),
    ("siliconvalley.txt", 20799, "38aff7ae38a2641fda8af17253d499d88b38a6fafe4354a84382030509b3f717"),
    ("startuplessons.txt", 27038, "1c3a8333c9e811a2a5e767fcb727ac95636c2e2f9c46cfb9382e89c61334fbb7"),
    ("submarine.txt", 13144, "d2fb6c30bd79b72f1175a371a93111d28e72031c45d5f4c93ae266bc230cb70a"),
    ("sun.txt", 2565, "d385ec133053cb65122433d2cff33fe432b2b1de3a1b7fee98b86bb95b21a1a9"),
    ("superangels.txt", 20115, "e22283992fb67f0b58902edb75fb29589d3f784fd34a558e754b9d2e5352f33d"),
    ("todo.txt", 1285, "49279cde1dc748aa77aed6695d961be110030c4058dc582fa6a633ce64a7d79b"),
    ("unions.txt", 3024, "072bce8c460b4f91af5650a00d0a928a5d70868e7164f1158afdc4336b7b82f5"),
    ("useful.txt", 16197, "27ec97ef3c99d6be7f0529611d9a88fd5ee1917e34eddac9e4024400d26df5ba"),
    ("vb.txt", 9155, "58abf15e074b35662f0e09da0020c65b3a09f27a44c0c2508d24eca53a71ac3b"),
    ("vcsqueeze.txt", 8956, "70bd68bd1c44cd07f190d12e7f09e327901e80b11bac447500d767d37d0e1bd3"),
    ("vw.txt", 4866, "0e3ce943e9967dbde5c6b757fd6c65fc17eac4f8c20e0838e71fd45824757c9e"),
    ("want.txt", 2740, "43b5f460f3321b9c736c33d7b4129c80c9d373ee5c272cf975434d28a3cf4635"),
    ("web20.txt", 19128, "d8078da5dda03538605661f5b07412744b8b432810cbd580b5896ba7c3d9c68b"),
    ("weird.txt", 2106, "5563700b07211d823bc904bc78f39830941f41b3cfc7882d67b86d0544746efd"),
    ("wisdom.txt", 21853, "cdc71c4962e5bc3d1f38f120e5df9837eb1100fef63b23d06ff115896e577ba0"),
    ("worked.txt", 74663, "7a9a464c75d8b515aa9ee3921a1e28f53a2d1c227f111cb67007ebf0a008bfa3"),
)


@dataclass(frozen=True)
class Opening:
    """The essays a text opens with: ``names`` in the text's order, ending at character ``end``."""

    names: tuple[str, ...]
    end: int

    def complete(self, table: tuple[tuple[str, int, str], ...]) -> bool:
        """Every essay of ``table``, each once."""
        return len(self.names) == len(table)

    def sorted(self, table: tuple[tuple[str, int, str], ...]) -> bool:
        """Every essay of ``table`` in its (sorted) order, as RULER's downloads since 2024-08-20 hold them."""
        return self.names == tuple(name for name, _, _ in table)


def essays_opening(text: str, table: tuple[tuple[str, int, str], ...]) -> Opening:
    """The longest run of distinct essays of ``table`` that ``text`` opens with, in any order.

    Args:
        text: the haystack's text (after JSON decoding).
        table: ``(file name, characters, sha256)`` per essay.

    Returns:
        The essays matched from character 0, in order, and the character where the run ends (0 when none).
    """
    left = {(chars, digest): name for name, chars, digest in table}
    names: list[str] = []
    pos = 0
    while left:
        found = None
        for chars in sorted({c for c, _ in left}):
            if pos + chars > len(text):
                break
            key = (chars, hashlib.sha256(text[pos:pos + chars].encode("utf-8")).hexdigest())
            if key in left:
                found = key
                break
        if found is None:
            break
        names.append(left.pop(found))
        pos += found[0]
    return Opening(tuple(names), pos)
