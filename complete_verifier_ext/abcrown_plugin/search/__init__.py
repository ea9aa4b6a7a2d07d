"""α,β-CROWN's searches at P > 1: the generic round of a list split over the ranks (:mod:`.rounds`),
activation BaB (:mod:`.activation`), input-split BaB (:mod:`.input_split`), BICCOS cuts (:mod:`.cuts`),
MIP solves dealt (:mod:`.mip`), a ``Customized`` verifier on rank 0 (:mod:`.customized`), and what
cannot run split yet (:mod:`.refusals`)."""
